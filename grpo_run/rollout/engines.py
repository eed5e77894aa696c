"""The generation engine protocol: what the trainer and the evaluation call to sample completions.

An engine turns B left-padded prompts into a `Rollout` of B·G completions (row b·G + g is completion g
of prompt b) from the policy's current weights. Implementations are chosen by the `generation` config
group and built in one place; the loop never imports one directly:
    local (our KV-cached group sampler: the native decoder, or transformers' forward for any model)
    vllm  (a colocated vllm.LLM, weights pushed in after every optimizer step)
"""

from typing import Protocol

import torch

from grpo_run.rollout.generate import Rollout, SamplingParams


class GenerationEngine(Protocol):
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
