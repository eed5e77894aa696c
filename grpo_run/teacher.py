"""On-policy distillation's teacher: log-probs of the student's sampled tokens under the teacher, or its
full next-token distributions there (docs/algorithm.md). The update asks the `Teacher` protocol;
`run_context.load_teacher` builds one of the two implementations from the `distill` group. Both score
with `passes.frozen_logprobs`, the pass that gives π_old and π_ref, or `frozen_states`."""

from dataclasses import replace
from typing import NamedTuple, Protocol

import torch
from transformers import PreTrainedTokenizerBase

from grpo_run.algo import HeadStates
from grpo_run.config.schema import DataConfig
from grpo_run.data import Example
from grpo_run.data.prompts import encode_teacher_prompts
from grpo_run.micro_batches import micro_batches
from grpo_run.models.dropout import eval_mode
from grpo_run.models.forward import TrainingForward, trim_columns
from grpo_run.passes import Between, frozen_logprobs
from grpo_run.rollout.generate import Rollout


class TeacherScores(NamedTuple):
    """What the teacher gives the update: log π_teacher of each sampled token [N, T] and, where the form
    needs full distributions (`DistillFormSpec.teacher_states`), the LM head's input at each completion
    position [N, T, H] with its head (else None)."""

    logprobs: torch.Tensor
    states: HeadStates | None = None


class Teacher(Protocol):
    def logprobs(
        self, rollout: Rollout, examples: list[Example], between: Between | None = None
    ) -> torch.Tensor:
        """log π_teacher of every completion token [N, T] (row b·G + g: completion g of examples[b]), on
        the rollout's device, without gradient; only the sampled token's log-prob, so the teacher's
        vocabulary may be padded differently from the student's. between: called before each of its
        micro-batches (`frozen_logprobs`)."""
        ...

    def states(
        self, rollout: Rollout, examples: list[Example], between: Between | None = None
    ) -> TeacherScores:
        """The sampled tokens' log-probs and the head's input at every completion position [N, T, H]
        with the head's weight, both on the rollout's device, without gradient (`frozen_states`)."""
        ...


def score(
    teacher: Teacher, rollout: Rollout, examples: list[Example], between: Between | None, *, states: bool
):
    """The teacher's `TeacherScores` of a rollout: with its head states when `states`, else log-probs only."""
    if states:
        return teacher.states(rollout, examples, between)
    return TeacherScores(teacher.logprobs(rollout, examples, between))


@torch.no_grad()
def frozen_states(
    rollout: Rollout,
    *,
    forward: TrainingForward,
    model: torch.nn.Module,
    micro_batch_size: int,
    between: Between | None = None,
) -> TeacherScores:
    """`frozen_logprobs` and the LM head's input at every completion position [N, T, H] (0 in the columns
    a micro-batch trims), with the head's weight as the forward reads it: one pass, micro-batched."""
    n, t = rollout.completion_ids.shape
    device = rollout.completion_ids.device
    logprobs = torch.zeros(n, t, dtype=torch.float32, device=device)  # [N, T]
    hidden = None
    head = None
    with eval_mode(model):  # no dropout mask, as in frozen_logprobs
        for mb in micro_batches(n, micro_batch_size):
            if between is not None:
                between()
            p_ids, p_mask, c_ids, _ = trim_columns(
                rollout.prompt_ids[mb],
                rollout.prompt_mask[mb],
                rollout.completion_ids[mb],
                rollout.completion_mask[mb],
            )
            lp, _, head = forward.head_states(model, p_ids, p_mask, c_ids, with_entropy=False)
            logprobs[mb, : lp.size(1)] = lp
            if hidden is None:
                hidden = head.hidden.new_zeros(n, t, head.hidden.size(-1))  # [N, T, H]
            hidden[mb, : lp.size(1)] = head.hidden
    assert head is not None and hidden is not None, "a rollout has at least one row"
    return TeacherScores(logprobs, head._replace(hidden=hidden, weight=head.weight.detach()))


def scores_on(
    scores: TeacherScores, device: torch.device, *, weight: torch.Tensor | None = None
) -> TeacherScores:
    """`scores` on `device` (the policy's), the head's weight replaced by `weight` when given (a copy
    already there)."""
    states = scores.states
    if states is not None:
        moved = states.weight.to(device) if weight is None else weight
        states = states._replace(hidden=states.hidden.to(device), weight=moved)
    return TeacherScores(scores.logprobs.to(device), states)


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
        self._head_here: torch.Tensor | None = None  # the frozen head's weight on the policy's device

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

    def states(
        self, rollout: Rollout, examples: list[Example], between: Between | None = None
    ) -> TeacherScores:
        there = rollout_on(rollout, self.device)
        scores = frozen_states(
            there,
            forward=self.forward,
            model=self.model,
            micro_batch_size=self.micro_batch_size,
            between=between,
        )
        here = rollout.completion_ids.device
        if here == self.device:
            return scores
        if self._head_here is None:  # the frozen weights never change: copied over once
            self._head_here = scores.states.weight.to(here)
        return scores_on(scores, here, weight=self._head_here)


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

    def taught(self, rollout: Rollout, examples: list[Example]) -> Rollout:
        """The rollout with the teacher's prompts in place of the student's."""
        ids, mask = self.prompts(examples, rollout.prompt_ids.device)  # [N, P']
        if ids.size(0) != rollout.completion_ids.size(0):
            raise ValueError(f"{len(examples)} examples x G={self.group_size} != {ids.size(0)} rows")
        return replace(rollout, prompt_ids=ids, prompt_mask=mask)

    def states(
        self, rollout: Rollout, examples: list[Example], between: Between | None = None
    ) -> TeacherScores:
        """The head's weight is the policy's at π_old time: copied, since the update then changes it."""
        scores = frozen_states(
            self.taught(rollout, examples),
            forward=self.forward,
            model=self.policy,
            micro_batch_size=self.micro_batch_size,
            between=between,
        )
        return scores._replace(states=scores.states._replace(weight=scores.states.weight.clone()))

    def logprobs(
        self, rollout: Rollout, examples: list[Example], between: Between | None = None
    ) -> torch.Tensor:
        taught = self.taught(rollout, examples)
        return frozen_logprobs(
            taught,
            forward=self.forward,
            model=self.policy,
            micro_batch_size=self.micro_batch_size,
            between=between,
        )
