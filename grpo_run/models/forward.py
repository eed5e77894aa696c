"""The training forward: per-token log-probs (and entropy) of completions under the policy.

`TrainingForward` is what the update and the old/reference passes call; `TransformersForward` is its
plain implementation on transformers' own forward (any causal LM). The fast path's implementation is
`grpo_run/native/forward.py`; `grpo_run/backend.py` chooses between them from the `backend` group.
"""

import contextlib
from collections.abc import Iterator
from typing import Protocol

import torch
from transformers import PreTrainedModel

from grpo_run.algo import HeadStates, token_entropy, token_logprobs, token_logprobs_and_entropy
from grpo_run.packing import PackedRows, PackingState, pack_rows


def trim_columns(
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Drop prompt columns that are padding in every row and completion columns past the last token.

    Left padding and finished sequences leave columns no row needs; attention never lets a later
    column change an earlier one, so the log-probs of the kept tokens are unchanged.
    """
    keep_from = int(prompt_mask.any(dim=0).int().argmax())  # first column with a real token
    keep_to = max(int(completion_mask.sum(dim=1).max()), 1)
    return (
        prompt_ids[:, keep_from:],
        prompt_mask[:, keep_from:],
        completion_ids[:, :keep_to],
        completion_mask[:, :keep_to],
    )


def concatenated(
    prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's prompt [n, P] and completion [n, T] as one sequence: (ids, mask, positions [n, P+T],
    the T columns [T] that predict the completion tokens)."""
    t = completion_ids.size(1)
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)  # [n, P+T]
    attention = torch.cat([prompt_mask, torch.ones_like(completion_ids)], dim=1)  # [n, P+T]
    positions = (attention.cumsum(dim=1) - 1).clamp(min=0)  # [n, P+T]
    # Column P-1+j predicts completion token j: only those T columns go through the LM head, so the
    # logits come out contiguous (no [n, T+1, V] tensor sliced and copied, no unused last column).
    cols = torch.arange(input_ids.size(1) - t - 1, input_ids.size(1) - 1, device=input_ids.device)  # [T]
    return input_ids, attention, positions, cols


class TrainingForward(Protocol):
    # trainer.padding_free: the run's packing (budget, on until its first check fails); None: padded
    packing: PackingState | None
    autocast_bf16: bool  # its passes run under bf16 autocast (the packing check turns it off for its own)

    def logprobs(
        self,
        model: torch.nn.Module,
        prompt_ids: torch.Tensor,  # [n, P] left-padded
        prompt_mask: torch.Tensor,  # [n, P]
        completion_ids: torch.Tensor,  # [n, T]
        *,
        with_entropy: bool,
        entropy_grad: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(log-probs [n, T], entropy [n, T] or None) at the sampling temperature; with gradient when
        autograd is on (the entropy only with `entropy_grad`)."""
        ...

    def packed_logprobs(
        self,
        model: torch.nn.Module,
        prompt_ids: torch.Tensor,  # [n, P] left-padded
        prompt_mask: torch.Tensor,  # [n, P]
        completion_ids: torch.Tensor,  # [n, T]
        completion_mask: torch.Tensor,  # [n, T] 1 up to the first EOS
        *,
        with_entropy: bool,
        entropy_grad: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`logprobs` of the rows packed into one row (`packing.pack_rows`, padding never computed):
        (log-probs [n, T'], entropy [n, T'] or None) with T' the longest completion, 0 past each row's."""
        ...

    def head_states(
        self,
        model: torch.nn.Module,
        prompt_ids: torch.Tensor,  # [n, P] left-padded
        prompt_mask: torch.Tensor,  # [n, P]
        completion_ids: torch.Tensor,  # [n, T]
        *,
        with_entropy: bool,
        entropy_grad: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None, HeadStates]:
        """`logprobs`'s (log-probs, entropy), and the LM head's input at the T positions that predict the
        completion [n, T, H] with the head's weight [V, H] (distill.form=distribution: the full
        next-token distributions), from one forward pass; with gradient when autograd is on."""
        ...

    def optimizer_step(self, model: torch.nn.Module, micro_batches: int) -> contextlib.AbstractContextManager:
        """The scope of one optimizer step's `micro_batches` forward/backward passes: whatever an
        implementation keeps across them (weights cast once) lives exactly as long as the scope."""
        ...

    def release_memory(self) -> None:
        """Between the phases of a step (after generation, after the update): give freed memory back."""
        ...


def completion_logprobs(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    *,
    temperature: float,
    chunk_size: int,
    with_entropy: bool = False,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """prompt [n, P] + completion [n, T] → (log-probs [n, T], entropy [n, T] or None), transformers' forward.

    Log-probs come from the temperature-scaled logits, the distribution the tokens were sampled
    from. Only the T positions that predict a completion token go through the LM head. The entropy
    carries gradient only with `entropy_grad` (an entropy bonus in the loss); as a metric it is
    computed without autograd, from the same log-softmax pass.
    """
    ids, attention, positions, cols = concatenated(prompt_ids, prompt_mask, completion_ids)
    logits = model(
        input_ids=ids, attention_mask=attention, position_ids=positions, logits_to_keep=cols
    ).logits
    return logprobs_from_logits(logits, completion_ids, temperature, chunk_size, with_entropy, entropy_grad)


def packed_attention_mask(pack: PackedRows) -> torch.Tensor | None:
    """The attention mask transformers' forward gets with a packed row: None, so that it derives the
    sequences from the restarting positions (a block-diagonal causal mask under eager and sdpa attention,
    variable-length kernels under flash-attention)."""
    return None


def packed_completion_logprobs(
    model: torch.nn.Module,
    pack: PackedRows,
    *,
    temperature: float,
    chunk_size: int,
    with_entropy: bool = False,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`completion_logprobs` of a packed micro-batch through transformers' forward: (log-probs [n, T],
    entropy [n, T] or None), from the K packed columns that predict completion tokens."""
    if pack.shares_prompts:
        raise ValueError("transformers' forward takes packed rows without shared prompts")
    logits = model(
        input_ids=pack.ids,
        attention_mask=packed_attention_mask(pack),
        position_ids=pack.positions,
        logits_to_keep=pack.cols,
        use_cache=False,  # transformers derives the sequences from the positions only without a cache
    ).logits  # [1, K, V]
    lp, entropy = logprobs_from_logits(
        logits, pack.targets, temperature, chunk_size, with_entropy, entropy_grad
    )
    return pack.unpack(lp), None if entropy is None else pack.unpack(entropy)


def logprobs_from_logits(
    logits: torch.Tensor,
    completion_ids: torch.Tensor,
    temperature: float,
    chunk_size: int,
    with_entropy: bool,
    entropy_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """logits [n, T, V] of the columns predicting completion_ids [n, T] → (log-probs, entropy or None)."""
    if with_entropy and not entropy_grad:  # the metric: one log-softmax pass gives both
        return token_logprobs_and_entropy(logits, completion_ids, temperature, chunk_size)
    logprobs = token_logprobs(logits, completion_ids, temperature=temperature, chunk_size=chunk_size)
    entropy = None
    if with_entropy:
        entropy = token_entropy(logits, temperature=temperature, chunk_size=chunk_size)  # [n, T]
    return logprobs, entropy


def plain_head_weight(model: torch.nn.Module) -> torch.Tensor:
    """The LM head's weight [V, H]; a head that is not a bias-free linear map cannot give distributions
    from its input alone (distill.form=distribution)."""
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear) or head.bias is not None:
        raise ValueError(
            f"distill.form=distribution needs a bias-free linear LM head; {type(model).__name__} has "
            f"{type(head).__name__}"
        )
    return head.weight


def matmul_dtype(weight: torch.Tensor) -> torch.dtype:
    """The dtype the LM head's matmul runs in: autocast's where it is on, else the weight's."""
    device = weight.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype


def completion_head_states(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    *,
    temperature: float,
    chunk_size: int,
    with_entropy: bool = False,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, HeadStates]:
    """`completion_logprobs` and the head's input it comes from, through transformers' base model (the
    decoder, its final norm included) and the head's weight: (log-probs [n, T], entropy or None, states)."""
    ids, attention, positions, cols = concatenated(prompt_ids, prompt_mask, completion_ids)
    out = model.base_model(input_ids=ids, attention_mask=attention, position_ids=positions)
    hidden = out.last_hidden_state[:, cols]  # [n, T, H]
    weight = plain_head_weight(model)  # [V, H]
    logits = torch.nn.functional.linear(hidden, weight)  # [n, T, V] as the model's own head makes them
    lp, entropy = logprobs_from_logits(
        logits, completion_ids, temperature, chunk_size, with_entropy, entropy_grad
    )
    return lp, entropy, HeadStates(hidden, weight, temperature, matmul_dtype(weight), chunk_size)


def autocast_scope(device: torch.device, enabled: bool) -> contextlib.AbstractContextManager:
    """bf16 autocast on `device` when `model.autocast_bf16` asks for it."""
    return torch.autocast(device.type, dtype=torch.bfloat16) if enabled else contextlib.nullcontext()


class TransformersForward:
    """The plain training forward: transformers' own model call under the model config's autocast."""

    def __init__(
        self,
        *,
        temperature: float,
        chunk_size: int,
        autocast_bf16: bool,
        device: torch.device,
        packing: PackingState | None = None,
    ) -> None:
        self.temperature = temperature
        self.chunk_size = chunk_size
        self.autocast_bf16 = autocast_bf16
        self.device = device
        self.packing = packing

    def logprobs(self, model, prompt_ids, prompt_mask, completion_ids, *, with_entropy, entropy_grad=False):
        with autocast_scope(self.device, self.autocast_bf16):
            return completion_logprobs(
                model,
                prompt_ids,
                prompt_mask,
                completion_ids,
                temperature=self.temperature,
                chunk_size=self.chunk_size,
                with_entropy=with_entropy,
                entropy_grad=entropy_grad,
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
        pack = pack_rows(prompt_ids, prompt_mask, completion_ids, completion_mask)
        with autocast_scope(self.device, self.autocast_bf16):
            return packed_completion_logprobs(
                model,
                pack,
                temperature=self.temperature,
                chunk_size=self.chunk_size,
                with_entropy=with_entropy,
                entropy_grad=entropy_grad,
            )

    def head_states(
        self, model, prompt_ids, prompt_mask, completion_ids, *, with_entropy, entropy_grad=False
    ):
        with autocast_scope(self.device, self.autocast_bf16):
            return completion_head_states(
                model,
                prompt_ids,
                prompt_mask,
                completion_ids,
                temperature=self.temperature,
                chunk_size=self.chunk_size,
                with_entropy=with_entropy,
                entropy_grad=entropy_grad,
            )

    @contextlib.contextmanager
    def optimizer_step(self, model: PreTrainedModel, micro_batches: int) -> Iterator[None]:
        yield

    def release_memory(self) -> None:
        pass
