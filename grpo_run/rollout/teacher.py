"""On-policy distillation's teacher: log-probs of the student's sampled tokens under the teacher
(docs/algorithm.md). The update asks the `Teacher` protocol; `run_context.load_teacher` builds one of the
two implementations from the `distill` group. Both score with `rollout.logprobs.frozen_logprobs`, the
pass that gives π_old and π_ref."""

from dataclasses import replace
from typing import Protocol

import torch
from transformers import PreTrainedTokenizerBase

from grpo_run.config.schema import DataConfig
from grpo_run.data import Example
from grpo_run.data.prompts import encode_teacher_prompts
from grpo_run.models.forward import TrainingForward
from grpo_run.rollout.generate import Rollout
from grpo_run.rollout.logprobs import Between, frozen_logprobs


class Teacher(Protocol):
    def logprobs(
        self, rollout: Rollout, examples: list[Example], between: Between | None = None
    ) -> torch.Tensor:
        """log π_teacher of every completion token [N, T] (row b·G + g: completion g of examples[b]), on
        the rollout's device, without gradient; only the sampled token's log-prob, so the teacher's
        vocabulary may be padded differently from the student's. between: called before each of its
        micro-batches (`frozen_logprobs`)."""
        ...


def rollout_on(rollout: Rollout, device: torch.device) -> Rollout:
    """The token tensors the forward reads, on `device` (the rollout itself when they are there)."""
    if rollout.completion_ids.device == device:
        return rollout
    return Rollout(
        prompt_ids=rollout.prompt_ids.to(device),
        prompt_mask=rollout.prompt_mask.to(device),
        completion_ids=rollout.completion_ids.to(device),
        completion_mask=rollout.completion_mask.to(device),
        truncated=rollout.truncated.to(device),
    )


class FrozenTeacher:
    """distill=teacher: a frozen model (`distill.teacher.path`) on its own device or the policy's."""

    def __init__(
        self, model: torch.nn.Module, forward: TrainingForward, device: torch.device, micro_batch_size: int
    ) -> None:
        self.model, self.forward, self.device, self.micro_batch_size = (
            model,
            forward,
            device,
            micro_batch_size,
        )

    def logprobs(
        self, rollout: Rollout, examples: list[Example], between: Between | None = None
    ) -> torch.Tensor:
        there = rollout_on(rollout, self.device)
        lp = frozen_logprobs(
            there,
            forward=self.forward,
            model=self.model,
            micro_batch_size=self.micro_batch_size,
            between=between,
        )
        return lp.to(rollout.completion_ids.device)  # [N, T]


class SelfTeacher:
    """distill=self: the policy's current weights, the privileged context (`distill.teacher_context`) in
    its prompt; the completion tokens are the student's, only the prompt before them differs."""

    def __init__(
        self,
        policy: torch.nn.Module,
        forward: TrainingForward,
        tokenizer: PreTrainedTokenizerBase,
        *,
        data: DataConfig,
        context: str,
        group_size: int,
        micro_batch_size: int,
    ) -> None:
        self.policy, self.forward, self.tokenizer = policy, forward, tokenizer
        self.data, self.context = data, context
        self.group_size, self.micro_batch_size = group_size, micro_batch_size

    def prompts(self, examples: list[Example], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The teacher's prompt of every row: (ids, mask) [N, P'], each group's repeated G times."""
        ids, mask = encode_teacher_prompts(
            self.tokenizer, self.data, examples, self.context, device
        )  # [B, P']
        return ids.repeat_interleave(self.group_size, 0), mask.repeat_interleave(self.group_size, 0)

    def logprobs(
        self, rollout: Rollout, examples: list[Example], between: Between | None = None
    ) -> torch.Tensor:
        ids, mask = self.prompts(examples, rollout.prompt_ids.device)  # [N, P']
        if ids.size(0) != rollout.completion_ids.size(0):
            raise ValueError(f"{len(examples)} examples x G={self.group_size} != {ids.size(0)} rows")
        taught = replace(rollout, prompt_ids=ids, prompt_mask=mask)
        return frozen_logprobs(
            taught,
            forward=self.forward,
            model=self.policy,
            micro_batch_size=self.micro_batch_size,
            between=between,
        )
