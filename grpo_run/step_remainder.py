"""What a step stopped between two of its optimizer steps still needs (grpo.num_iterations = μ > 1).

A stop after the step's k-th optimizer step (1 ≤ k < μ) goes back to the state right after it: the
engine's weights, optimizer and schedule as they are (the passes cut short never reach `engine.step()`),
the RNG states taken right after that optimizer step, and this remainder: the batch the other passes
train on (rollout tensors, advantages, loss mask, normalizer, old/reference/teacher log-probs, skipped
loss tokens), k, the step's metrics accumulated up to then and its timings. Each rank saves its own (its
rows, its share of the sums) beside the checkpoint (`REMAINDER`), listed in the manifest like every
file, so `resume=auto` runs passes k..μ−1 on it and logs the step once, as the uninterrupted run does.
"""

import pickle
from dataclasses import dataclass, fields, is_dataclass
from pathlib import Path
from typing import Any

import torch

from grpo_run.algo import HeadStates
from grpo_run.checkpoint import CheckpointError
from grpo_run.rollout.generate import Rollout
from grpo_run.update import TrainingBatch

REMAINDER = "step_remainder_rank{rank}.pt"
FORMAT = 1


@dataclass
class StepSeconds:
    """A step's timings so far as durations (what travels in the remainder): before its update, in its
    update, generating; and the tokens it sampled (perf/*)."""

    before_update: float
    in_update: float
    generate_s: float
    tokens: float


@dataclass
class StepClock:
    """A step's timings (time.perf_counter): when it began, when its update began; what generation took
    and how many tokens it sampled (perf/*)."""

    t0: float
    t_ref: float
    generate_s: float
    tokens: float

    def elapsed(self, now: float) -> StepSeconds:
        return StepSeconds(self.t_ref - self.t0, now - self.t_ref, self.generate_s, self.tokens)

    @staticmethod
    def resumed(now: float, seconds: StepSeconds) -> "StepClock":
        """The clock of a step resumed at `now`: the time it spent before the stop counts, the time
        between the two processes does not."""
        t_ref = now - seconds.in_update
        return StepClock(t_ref - seconds.before_update, t_ref, seconds.generate_s, seconds.tokens)


@dataclass
class Remainder:
    """The rest of a step after `iterations_done` optimizer steps (see the module's docstring)."""

    batch: TrainingBatch
    entropy_coef: float  # the step's entropy bonus (the controller moves it only after the step)
    iterations_done: int
    metrics: tuple[dict, dict, dict, dict]  # `StepMetrics.parts()` right after the last optimizer step
    seconds: StepSeconds  # its timings right after the last optimizer step


def _plain(value: Any) -> Any:
    """Tensors on the CPU, dataclasses as dicts: what torch.load(weights_only=True) reads back."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if is_dataclass(value):
        return {f.name: _plain(getattr(value, f.name)) for f in fields(value)}
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a NamedTuple (HeadStates): by name
        return {name: _plain(getattr(value, name)) for name in value._fields}
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _to(value: Any, device: torch.device) -> Any:
    return value.to(device) if isinstance(value, torch.Tensor) else value


def file_contents(remainder: Remainder) -> dict[str, Any]:
    """The remainder as one torch.save'd dict (every tensor on the CPU; dict order kept, so the step's
    metrics keep their order)."""
    return {"format": FORMAT, **_plain(remainder)}


def load_remainder(folder: Path, rank: int, device: torch.device) -> Remainder:
    """This rank's remainder from a checkpoint saved inside a step; a missing or unreadable file is named."""
    path = folder / REMAINDER.format(rank=rank)
    if not path.is_file():
        raise CheckpointError(f"{path}: missing (the checkpoint was saved inside a step and needs it)")
    try:
        data = torch.load(path, weights_only=True, map_location="cpu")
    except (pickle.UnpicklingError, RuntimeError, EOFError) as err:  # refused, torn or not torch's format
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise CheckpointError(f"{path}: unreadable ({first})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a step remainder of format {FORMAT}")
    saved = dict(data["batch"])
    rollout = Rollout(**{k: _to(v, device) for k, v in saved.pop("rollout").items()})
    if saved.get("teacher_states") is not None:  # distill.form=distribution: the teacher's head states
        saved["teacher_states"] = HeadStates(
            **{k: _to(v, device) for k, v in saved["teacher_states"].items()}
        )
    batch = TrainingBatch(rollout=rollout, **{k: _to(v, device) for k, v in saved.items()})
    sums, counts, maxes, host = data["metrics"]
    return Remainder(
        batch,
        float(data["entropy_coef"]),
        int(data["iterations_done"]),
        (sums, counts, maxes, host),
        StepSeconds(**data["seconds"]),
    )
