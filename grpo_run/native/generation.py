"""The fast path's generation engine: our group sampler on the native decoder, from a bf16 copy.

`NativeEngine` implements `rollout.engines.GenerationEngine`. It samples from the policy's weights
rounded to bf16 (`sampling_copy.py`) when the policy is float32 under bf16 autocast, rebuilt lazily after
`policy_updated()` and freed after every generation, and runs the native decoder (`decoder.py`) on
Llama-family models (transformers' forward on others under `backend.decoder=auto`).
"""

from collections.abc import Callable

import torch
from transformers import PreTrainedModel

from grpo_run.native.decoder import native_decoder
from grpo_run.native.sampling_copy import SamplingWeights, wants_bf16_copy
from grpo_run.rollout.decoders import ContinuesRows
from grpo_run.rollout.engines import LOCAL_CAPABILITIES, sample_local
from grpo_run.rollout.generate import Decoding, Rollout
from grpo_run.rollout.turns import CachedTurns


class NativeEngine:
    """`GenerationEngine` on the fast path (module docstring): the plain engines' group sampler
    (`rollout.engines.sample_local`) with the native decoder, on the policy or its bf16 copy."""

    # Multi-turn: the native decoder continues an episode's cache (`open_turns`, rollout/turns.OpensTurns).
    CAPABILITIES = LOCAL_CAPABILITIES

    def __init__(
        self,
        policy: PreTrainedModel,
        *,
        eos_id: int,
        pad_id: int,
        autocast_bf16: bool,
        decoder: str,
        bf16_sampling_copy: bool,
        owns_policy: bool = False,
        make_copy: Callable[[PreTrainedModel], SamplingWeights] | None = None,
        report_logprobs: bool = False,
    ) -> None:
        """owns_policy: nothing else uses the policy's weights (mode=eval), so a wanted bf16 copy is made
        by converting the policy in place instead of beside it. make_copy: builds a wanted bf16 copy
        instead of `SamplingWeights` (LoRA: `models.lora.MergedSamplingWeights`, the adapters merged).
        report_logprobs: as `TransformersEngine`'s (the log-probs of the weights sampled from: the bf16
        copy when there is one)."""
        wanted = wants_bf16_copy(
            autocast_bf16=autocast_bf16,
            weight_dtype=next(policy.parameters()).dtype,
            enabled=bf16_sampling_copy,
        )
        if wanted and owns_policy:
            policy.to(torch.bfloat16)
            wanted = False
        if wanted and make_copy is not None:
            self.weights = make_copy(policy)
        else:
            self.weights = SamplingWeights(policy, bf16_copy=wanted)
        self.decoding = Decoding(
            eos_id,
            pad_id,
            make_decoder=native_decoder(policy, decoder),
            autocast_bf16=autocast_bf16,
            with_logprobs=report_logprobs,
        )
        self.version = 0  # policy_updated() calls: an open CachedTurns of an older version is stale

    @property
    def samples_from_copy(self) -> bool:
        return self.weights.is_copy

    def generate(self, prompt_ids, prompt_mask, *, group_size, params, seeds) -> Rollout:
        model = self.weights.model()  # the policy, or its bf16 copy rebuilt from it when stale
        try:
            return sample_local(
                model,
                prompt_ids,
                prompt_mask,
                group_size=group_size,
                params=params,
                seeds=seeds,
                decoding=self.decoding,
            )
        finally:
            self.weights.release()  # the update runs without the copy in memory

    def open_turns(self, prompt_ids, prompt_mask, *, group_size) -> CachedTurns | None:
        """Multi-turn episodes continue the native decoder's cache (`rollout/turns.py`); the weights
        (the bf16 copy) stay in memory until the sampler closes."""
        if not issubclass(self.decoding.make_decoder, ContinuesRows):
            return None
        return CachedTurns(
            self.weights.model(),
            prompt_ids,
            prompt_mask,
            group_size=group_size,
            decoding=self.decoding,
            version=lambda: self.version,
            on_close=self.weights.release,
        )

    def policy_updated(self) -> None:
        self.version += 1
        self.weights.mark_stale()

    def close(self) -> None:
        self.weights.release()
