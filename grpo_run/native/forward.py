"""The fast path's training forward: log-probs of completions through the written-out Llama layers.

`NativeForward` implements `models.forward.TrainingForward` with the pieces of this package: the
native layers (`layers.py`), rows sharing a prompt sharing its forward (`shared_prompt.py`), the LM head
fused into the chunked log-softmax (`fused_head.py`), the projections' weights cast to bf16 once per
optimizer step (`weight_casts.py`) and heap trims between phases (`heap.py`). The same log-probs as
transformers' forward to float rounding (`tests/native/`); a model outside the Llama family runs
transformers' forward under `backend.forward=auto`.
"""

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from grpo_run.algo import HeadStates
from grpo_run.models.forward import (
    autocast_scope,
    completion_head_states,
    concatenated,
    logprobs_from_logits,
    matmul_dtype,
    packed_completion_logprobs,
    plain_head_weight,
)
from grpo_run.models.forward import completion_logprobs as plain_logprobs
from grpo_run.native.fused_head import head_token_logprobs
from grpo_run.native.heap import MIN_FREE_BYTES, release_free_memory
from grpo_run.native.layers import LlamaLayers, native_hidden, resolve_backend
from grpo_run.native.packed import packed_hidden
from grpo_run.native.sampling_copy import wants_bf16_copy
from grpo_run.native.shared_prompt import shared_prompt_hidden
from grpo_run.native.weight_casts import WeightCasts
from grpo_run.packing import PackingState, pack_rows


def head_input(
    net: LlamaLayers,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    *,
    share_prompts: bool,
) -> torch.Tensor:
    """Native backend: prompt [n, P] + completion [n, T] -> the LM head's input [n, T, hidden] at the
    columns that predict the completion (rows sharing a prompt share its forward with `share_prompts`)."""
    hidden = shared_prompt_hidden(net, prompt_ids, prompt_mask, completion_ids) if share_prompts else None
    if hidden is None:  # not asked for, or nothing to share
        ids, attention, positions, cols = concatenated(prompt_ids, prompt_mask, completion_ids)
        hidden = native_hidden(net, ids, attention, positions)[:, cols]
    return net.final_norm(hidden)


@dataclass(frozen=True)
class NativeSettings:
    """How `native_completion_logprobs` runs: the temperature and log-softmax chunk of
    `models.forward.completion_logprobs`, and the fast path's knobs of the `backend` group.

    backend (`backend.forward`): 'native' (`layers.py`, Llama family), 'hf' (transformers' forward) or
    'auto' (native where it can run); the same logits either way.
    share_prompts (`backend.shared_prompt_forward`): rows with the same prompt share its forward
    (`shared_prompt.py`).
    fused_head (`backend.fused_lm_head`, no entropy gradient): the LM head and the log-softmax run chunk
    by chunk of rows (`fused_head.py`), so no [n, T, V] logits exist.
    trim_every_layers (`backend.release_free_memory_layers`, training): the C heap's free pages go back
    to the OS every this many layers (`layers.run_layers`; 0: never).
    """

    temperature: float
    chunk_size: int
    backend: str = "auto"
    share_prompts: bool = False
    fused_head: bool = False
    trim_every_layers: int = 0


def native_completion_logprobs(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    *,
    settings: NativeSettings,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    weight_casts: WeightCasts | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`models.forward.completion_logprobs` through the native layers, as `settings` says: prompt [n, P] +
    completion [n, T] → (log-probs [n, T], entropy [n, T] or None).

    weight_casts (`backend.cast_weights_once`, bf16 autocast): the projections' weights cast once per
    optimizer step instead of at every use (`weight_casts.py`).
    """
    s = settings
    if resolve_backend(model, s.backend, "backend.forward") != "native":
        return plain_logprobs(
            model,
            prompt_ids,
            prompt_mask,
            completion_ids,
            temperature=s.temperature,
            chunk_size=s.chunk_size,
            with_entropy=with_entropy,
            entropy_grad=entropy_grad,
        )
    net = LlamaLayers(model, weight_casts, s.trim_every_layers, head_follows=True)
    hidden = head_input(net, prompt_ids, prompt_mask, completion_ids, share_prompts=s.share_prompts)
    if s.fused_head and not entropy_grad and model.get_output_embeddings().bias is None:
        weight, grad_blocks = net.head_weight()  # [V, hidden]
        device = weight.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype
        return head_token_logprobs(
            hidden,
            weight,
            completion_ids,
            s.temperature,
            s.chunk_size,
            with_entropy=with_entropy,
            dtype=dtype,
            weight_grad_blocks=grad_blocks,
        )
    logits = net.linear(model.get_output_embeddings(), hidden)  # [n, T, V]
    return logprobs_from_logits(
        logits, completion_ids, s.temperature, s.chunk_size, with_entropy, entropy_grad
    )


def native_packed_logprobs(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    *,
    settings: NativeSettings,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    weight_casts: WeightCasts | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`native_completion_logprobs` of the rows packed into one row (`packing.pack_rows`, each distinct
    prompt once with `settings.share_prompts`; `native/packed.py`): (log-probs [n, T'], entropy [n, T'] or
    None). Transformers' forward (without shared prompts) where the native layers cannot run the model."""
    s = settings
    native = resolve_backend(model, s.backend, "backend.forward") == "native"
    pack = pack_rows(
        prompt_ids, prompt_mask, completion_ids, completion_mask, share_prompts=native and s.share_prompts
    )
    if not native:
        return packed_completion_logprobs(
            model,
            pack,
            temperature=s.temperature,
            chunk_size=s.chunk_size,
            with_entropy=with_entropy,
            entropy_grad=entropy_grad,
        )
    net = LlamaLayers(model, weight_casts, s.trim_every_layers, head_follows=True)
    hidden = packed_hidden(net, pack)  # [1, K, hidden]
    if s.fused_head and not entropy_grad and model.get_output_embeddings().bias is None:
        weight, grad_blocks = net.head_weight()  # [V, hidden]
        lp, entropy = head_token_logprobs(
            hidden,
            weight,
            pack.targets,
            s.temperature,
            s.chunk_size,
            with_entropy=with_entropy,
            dtype=matmul_dtype(weight),
            weight_grad_blocks=grad_blocks,
        )
    else:
        logits = net.linear(model.get_output_embeddings(), hidden)  # [1, K, V]
        lp, entropy = logprobs_from_logits(
            logits, pack.targets, s.temperature, s.chunk_size, with_entropy, entropy_grad
        )
    return pack.unpack(lp), None if entropy is None else pack.unpack(entropy)


def native_head_states(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    *,
    settings: NativeSettings,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    weight_casts: WeightCasts | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, HeadStates]:
    """`native_completion_logprobs` and the head's input it comes from, with the head's weight as the
    native layers read it (its kept cast under autocast with `weight_casts`): (log-probs [n, T], entropy
    or None, states [n, T, H]). Transformers' forward (`models.forward.completion_head_states`) where the
    native layers cannot run the model."""
    s = settings
    if resolve_backend(model, s.backend, "backend.forward") != "native":
        return completion_head_states(
            model,
            prompt_ids,
            prompt_mask,
            completion_ids,
            temperature=s.temperature,
            chunk_size=s.chunk_size,
            with_entropy=with_entropy,
            entropy_grad=entropy_grad,
        )
    plain_head_weight(model)  # a bias-free linear head, or the error that names the model
    net = LlamaLayers(model, weight_casts, s.trim_every_layers, head_follows=True)
    hidden = head_input(net, prompt_ids, prompt_mask, completion_ids, share_prompts=s.share_prompts)
    weight = net.head_weight()[0]  # [V, hidden]: its gradient through autograd (used twice below)
    dtype = matmul_dtype(weight)
    states = HeadStates(hidden, weight, s.temperature, dtype, s.chunk_size)
    if s.fused_head and not entropy_grad:
        lp, entropy = head_token_logprobs(
            hidden,
            weight,
            completion_ids,
            s.temperature,
            s.chunk_size,
            with_entropy=with_entropy,
            dtype=dtype,
        )
        return lp, entropy, states
    logits = torch.nn.functional.linear(hidden, weight)  # [n, T, V]
    lp, entropy = logprobs_from_logits(
        logits, completion_ids, s.temperature, s.chunk_size, with_entropy, entropy_grad
    )
    return lp, entropy, states


class NativeForward:
    """`TrainingForward` on the fast path (module docstring); its settings come from the `backend` group.
    It shares the plain forward's helpers (`models.forward`), not its class."""

    def __init__(
        self,
        *,
        temperature: float,
        chunk_size: int,
        autocast_bf16: bool,
        device: torch.device,
        choice: str,
        share_prompts: bool,
        cast_weights_once: bool,
        fused_head: bool,
        release_free_memory: bool,
        trim_every_layers: int,
        packing: PackingState | None = None,
    ) -> None:
        self.packing = packing
        self.settings = NativeSettings(
            temperature,
            chunk_size,
            backend=choice,
            share_prompts=share_prompts,
            fused_head=fused_head,
            trim_every_layers=trim_every_layers if release_free_memory else 0,
        )
        self.autocast_bf16 = autocast_bf16
        self.device = device
        self.cast_weights_once = cast_weights_once
        self.release = release_free_memory
        self._casts: WeightCasts | None = None
        self._left = 0  # forward passes still to come in this optimizer step

    def logprobs(self, model, prompt_ids, prompt_mask, completion_ids, *, with_entropy, entropy_grad=False):
        casts = self._casts_for_this_pass()
        with autocast_scope(self.device, self.autocast_bf16):
            return native_completion_logprobs(
                model,
                prompt_ids,
                prompt_mask,
                completion_ids,
                settings=self.settings,
                with_entropy=with_entropy,
                entropy_grad=entropy_grad,
                weight_casts=casts,
            )

    def packed_logprobs(
        self,
        model,
        prompt_ids,
        prompt_mask,
        completion_ids,
        completion_mask,
        *,
        with_entropy,
        entropy_grad=False,
    ):
        casts = self._casts_for_this_pass()
        with autocast_scope(self.device, self.autocast_bf16):
            return native_packed_logprobs(
                model,
                prompt_ids,
                prompt_mask,
                completion_ids,
                completion_mask,
                settings=self.settings,
                with_entropy=with_entropy,
                entropy_grad=entropy_grad,
                weight_casts=casts,
            )

    def head_states(
        self, model, prompt_ids, prompt_mask, completion_ids, *, with_entropy, entropy_grad=False
    ):
        casts = self._casts_for_this_pass()
        with autocast_scope(self.device, self.autocast_bf16):
            return native_head_states(
                model,
                prompt_ids,
                prompt_mask,
                completion_ids,
                settings=self.settings,
                with_entropy=with_entropy,
                entropy_grad=entropy_grad,
                weight_casts=casts,
            )

    def _casts_for_this_pass(self) -> WeightCasts | None:
        """The step's kept casts for one more forward pass; before the step's last, they are handed out
        one last time (`release_on_use`: each freed with the graph that uses it)."""
        casts = self._casts
        if casts is not None:
            self._left -= 1
            if self._left == 0:
                casts.release_on_use()
        return casts

    @contextlib.contextmanager
    def optimizer_step(self, model: PreTrainedModel, micro_batches: int) -> Iterator[None]:
        """The weights stay fixed until the step's optimizer update: cast them once for all its passes
        (where a bf16 copy helps at all: float32 weights under bf16 autocast), and drop the casts with
        the scope, since the update makes them stale."""
        wanted = wants_bf16_copy(
            autocast_bf16=self.autocast_bf16,
            weight_dtype=next(model.parameters()).dtype,
            enabled=self.cast_weights_once,
        )
        self._casts, self._left = (WeightCasts() if wanted else None), micro_batches
        try:
            yield
        finally:
            self._casts, self._left = None, 0

    def release_memory(self) -> None:
        if self.release:
            release_free_memory(MIN_FREE_BYTES)  # a few MB free would only fault straight back in
