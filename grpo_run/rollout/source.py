"""Where a step's scored groups come from: the one protocol the loop calls, chosen by the `rollout` group.

SyncRollouts   rollout=sync   the trainer samples and scores the step's groups itself (`groups.sample_groups`)
(async)        rollout=async  a generation worker process samples ahead of the trainer: the box
                              `grpo_run/asynchronous/`, built by the run context; nothing else imports it
"""

from typing import Protocol

from grpo_run import metrics as M
from grpo_run.rollout.groups import GroupSampler, Sampled, sample_groups


class RolloutSource(Protocol):
    def sample(self, step: int, stats: M.StepMetrics) -> Sampled:
        """The scored groups step `step` trains on (its reward failures counted into `stats`)."""
        ...

    def trained(self, step: int, stats: M.StepMetrics) -> None:
        """Step `step`'s optimizer steps are done: the weights are version `step`."""
        ...

    def close(self) -> None: ...


class RolloutSourceError(RuntimeError):
    """A step's groups never came (a source's process died, failed or went silent); the run saves what it
    trained and ends (exit 1). `detail`: what to print in full (a traceback), the message its first line."""

    def __init__(self, message: str, detail: str = "") -> None:
        super().__init__(message)
        self.detail = detail or message


class SyncRollouts:
    """rollout=sync: the step's groups from the trainer's own generation engine."""

    def __init__(self, side: GroupSampler) -> None:
        self.side = side

    def sample(self, step: int, stats: M.StepMetrics) -> Sampled:
        return sample_groups(step, stats, self.side)

    def trained(self, step: int, stats: M.StepMetrics) -> None:
        pass  # the engine itself was told after each optimizer step (GenerationEngine.policy_updated)

    def close(self) -> None:
        pass  # the engine and the scorer belong to the run context
