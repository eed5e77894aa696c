"""The generation engine protocol: what the trainer and the evaluation call to sample completions.

An engine turns B left-padded prompts into a `Rollout` of B·G completions (row b·G + g is completion g
of prompt b) from the policy's current weights. Implementations are chosen by the `generation` config
group and built in one place; the loop never imports one directly:
    TransformersEngine  our KV-cached group sampler on transformers' forward (backend=plain, any model)
    NativeEngine        the same sampler on the fast path's decoder and bf16 copy (grpo_run/native/generation.py)
`grpo_run/backend.py` builds the one a config asks for.
"""

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from transformers import PreTrainedModel

from grpo_run.models.forward import autocast_scope
from grpo_run.rollout.decoders import HFDecoder
from grpo_run.rollout.generate import (
    CachedRows,
    Decoding,
    Rollout,
    SamplingParams,
    generate_group_completions,
)


@dataclass(frozen=True)
class EngineCapabilities:
    """What a generation engine can do, declared by its class (`CAPABILITIES`) and read through
    `backend.engine_capabilities(cfg)` before anything is built: the rest of the code asks this, never
    the engine's name."""

    # Its samples from the weights being trained count as on-policy: the update recomputes π_old with
    # the training forward, as the synchronous loop does (False: its own kernels, whose log-probs the
    # rollout correction keeps, as vLLM's).
    on_policy: bool
    # Holds a copy of the weights of its own, synced after each update (perf/weight_sync_s), and sizes
    # its context from every prompt it may continue (`prompts` at build time).
    own_weights: bool


class GenerationEngine(Protocol):
    CAPABILITIES: EngineCapabilities

    def generate(
        self,
        prompt_ids: torch.Tensor,  # [B, P] left-padded
        prompt_mask: torch.Tensor,  # [B, P]
        *,
        group_size: int,
        params: SamplingParams,
        seeds: list[int],  # one per prompt: (seed, step, prompt index) mixed by `group_seed`
    ) -> Rollout:
        """G completions for each prompt from the policy's weights as they are now."""
        ...

    def policy_updated(self) -> None:
        """The policy's weights changed (an optimizer step, a restored checkpoint): the next `generate`
        must sample from the new ones. Cheap to call; the engine decides when to sync."""
        ...

    def close(self) -> None:
        """Free what the engine holds (caches, a second copy of the weights, worker processes)."""
        ...


@runtime_checkable
class ReportsSyncTime(Protocol):
    """An engine with its own copy of the weights (vLLM) says how long pushing them took."""

    def take_sync_seconds(self) -> float:
        """Seconds spent syncing weights since the last call (perf/weight_sync_s)."""
        ...


@contextmanager
def sampling_mode(model: torch.nn.Module, device: torch.device, autocast_bf16: bool) -> Iterator[None]:
    """`model` in eval mode (restored after), under bf16 autocast when the config asks for it and the
    weights are float32 (bf16 weights run as they are)."""
    was_training = model.training
    model.eval()
    weights_fp32 = next(model.parameters()).dtype == torch.float32
    try:
        with autocast_scope(device, autocast_bf16 and weights_fp32):
            yield
    finally:
        model.train(was_training)


def sample_local(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    *,
    group_size: int,
    params: SamplingParams,
    seeds: list[int],
    decoding: Decoding,
    keep: list[CachedRows] | None = None,
) -> Rollout:
    """The local engines' one generation call, under `sampling_mode` with `decoding.autocast_bf16`;
    decoding, keep: see `generate_group_completions`."""
    with sampling_mode(model, prompt_ids.device, decoding.autocast_bf16):
        return generate_group_completions(
            model,
            prompt_ids,
            prompt_mask,
            group_size=group_size,
            params=params,
            seeds=seeds,
            decoding=decoding,
            keep=keep,
        )


# The local engines' (our group sampler from the policy's own weights, or its bf16 copy).
LOCAL_CAPABILITIES = EngineCapabilities(on_policy=True, own_weights=False)


class TransformersEngine:
    """The plain local engine: our group sampler on transformers' forward, from the policy itself."""

    CAPABILITIES = LOCAL_CAPABILITIES

    def __init__(
        self,
        policy: PreTrainedModel,
        *,
        eos_id: int,
        pad_id: int,
        autocast_bf16: bool,
        report_logprobs: bool = False,
    ) -> None:
        """report_logprobs: every Rollout carries the decoder's log-probs of its tokens (`sampler_logprobs`);
        the generation worker of rollout=async takes them as the behaviour policy's."""
        self.policy = policy
        self.decoding = Decoding(
            eos_id, pad_id, make_decoder=HFDecoder, autocast_bf16=autocast_bf16, with_logprobs=report_logprobs
        )

    def generate(self, prompt_ids, prompt_mask, *, group_size, params, seeds) -> Rollout:
        return self.sample(
            self.policy, prompt_ids, prompt_mask, group_size=group_size, params=params, seeds=seeds
        )

    def sample(self, model, prompt_ids, prompt_mask, *, group_size, params, seeds) -> Rollout:
        """The group sampler on `model` with this engine's decoder, EOS, padding and autocast."""
        return sample_local(
            model,
            prompt_ids,
            prompt_mask,
            group_size=group_size,
            params=params,
            seeds=seeds,
            decoding=self.decoding,
        )

    def policy_updated(self) -> None:
        pass  # it samples from the policy's own parameters

    def close(self) -> None:
        pass


class LazyEngine:
    """A `GenerationEngine` built on its first `generate` (or `open_turns`). Under rollout=async the
    trainer's engine serves only held-out evaluation, which may never run: a vLLM engine (its memory,
    its start-up) is then never built. A weight update before the build needs no sync: the engine is
    built from the weights as they are then."""

    def __init__(self, build: Callable[[], GenerationEngine]) -> None:
        self._build = build
        self._engine: GenerationEngine | None = None

    @property
    def built(self) -> bool:
        return self._engine is not None

    def engine(self) -> GenerationEngine:
        if self._engine is None:
            self._engine = self._build()
        return self._engine

    def generate(self, prompt_ids, prompt_mask, *, group_size, params, seeds) -> Rollout:
        return self.engine().generate(
            prompt_ids, prompt_mask, group_size=group_size, params=params, seeds=seeds
        )

    def open_turns(self, prompt_ids, prompt_mask, *, group_size):
        """The built engine's own multi-turn sampler where it has one (`rollout/turns.py`), else None."""
        opens = getattr(self.engine(), "open_turns", None)
        return None if opens is None else opens(prompt_ids, prompt_mask, group_size=group_size)

    def policy_updated(self) -> None:
        if self._engine is not None:
            self._engine.policy_updated()

    def close(self) -> None:
        if self._engine is not None:
            self._engine.close()
