"""Where the step's metrics go: a rich console (progress bar + compact line) and metrics.jsonl.

Only the main rank writes. A sink is anything with `log(step, metrics)` and `close()`.
"""

import json
import math
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from grpo_run import metrics as M

# Wide enough that no line of ours is ever wrapped, narrow enough that rich's layout stays cheap.
UNWRAPPED_WIDTH = 10_000


def stderr_console() -> Console:
    """rich's console on stderr. To a terminal: rich's own, wrapped at the terminal's width. To a file or a
    pipe (a log, Slurm's .err, `2>&1 | tee`): no wrapping, where rich would wrap at 80 columns and break a
    printed path or resume command in two; tables keep their natural width."""
    console = Console(stderr=True)
    if not console.is_terminal:
        console.soft_wrap = True
        console.width = UNWRAPPED_WIDTH
    return console


console = stderr_console()


class Sink(Protocol):
    def log(self, step: int, values: dict[str, float]) -> None: ...
    def close(self) -> None: ...


@runtime_checkable
class CompletionsSink(Protocol):
    """A sink that also takes sample completions (one dict per completion, same keys in every row)."""

    def log_completions(self, step: int, rows: list[dict[str, Any]]) -> None: ...


@runtime_checkable
class AlertSink(Protocol):
    """A sink that also raises alerts (W&B: `wandb.Run.alert`); the in-flight alarms call it once each."""

    def alert(self, title: str, text: str) -> None: ...


class JsonlSink:
    """One JSON object per step, flushed at once so that a killed run keeps every finished step."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file = path.open("a", encoding="utf-8")

    def log(self, step: int, values: dict[str, float]) -> None:
        record = {"step": step, **{k: (v if math.isfinite(v) else str(v)) for k, v in values.items()}}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def _interval(v: dict[str, float], key: str) -> str:
    low, high = v.get(key + M.CI_LOW), v.get(key + M.CI_HIGH)
    return "" if low is None or high is None else f" [{low:.2f}, {high:.2f}]"


def compact_line(step: int, total: int, v: dict[str, float]) -> str:
    """The key numbers of one step on one line."""
    held_out = (
        f"eval acc {v[M.EVAL_ACCURACY]:.3f}{_interval(v, M.EVAL_ACCURACY)} "
        f"mean@k {v.get(M.EVAL_MEAN_AT_K, float('nan')):.3f}{_interval(v, M.EVAL_MEAN_AT_K)}"
        if M.EVAL_ACCURACY in v
        else ""
    )
    if M.EVAL_REWARD_MEAN in v:  # eval.reward's score of the greedy answers
        reward = f"eval reward {v[M.EVAL_REWARD_MEAN]:.3f}{_interval(v, M.EVAL_REWARD_MEAN)}"
        held_out = f"{held_out} {reward}" if held_out else reward
    if M.REWARD_MEAN not in v:  # the step-0 evaluation record
        return f"step {step}/{total}  {held_out}"
    parts = [
        f"step {step}/{total}",
        f"reward {v.get(M.REWARD_MEAN, float('nan')):.3f}±{v.get(M.REWARD_STD, float('nan')):.3f}",
        f"zero_std {v.get(M.FRAC_REWARD_ZERO_STD, float('nan')):.2f}",
    ]
    if M.KL in v:
        parts.append(f"kl {v[M.KL]:.4f}")
    parts += [
        f"clip {v.get(M.CLIP_FRACTION, float('nan')):.3f}",
        f"loss {v.get(M.LOSS, float('nan')):+.4f}",
    ]
    # What a TRL user watches; a step whose update was skipped (no informative group) has none of the first three.
    if M.GRAD_NORM in v:
        parts.append(f"grad_norm {v[M.GRAD_NORM]:.3g}")
    if M.ENTROPY in v:
        parts.append(f"entropy {v[M.ENTROPY]:.3f}")
    if M.LR in v:
        parts.append(f"lr {v[M.LR]:.2e}")
    parts += [
        f"len {v.get(M.COMPLETION_LEN_MEAN, float('nan')):.1f}",
        f"{v.get(M.STEP_S, float('nan')):.2f}s",
    ]
    if M.TOKENS_PER_S in v:
        parts.append(f"{v[M.TOKENS_PER_S]:.0f} tok/s")
    calls = M.TRAIN_TOOL_CALL_RATE_BY.format("")  # eval.group_by with an environment: calls per bucket
    by_bucket = [f"{k[len(calls) :]} {x:.2f}" for k, x in v.items() if k.startswith(calls)]
    if by_bucket:
        parts.append("tool calls " + " ".join(by_bucket))
    if held_out:
        parts.append(held_out)
    if v.get(M.REWARD_ERRORS, 0) or v.get(M.REWARD_TIMEOUTS, 0):
        parts.append(
            f"[red]reward errors {v.get(M.REWARD_ERRORS, 0):.0f} timeouts {v.get(M.REWARD_TIMEOUTS, 0):.0f}"
        )
    return "  ".join(parts)


class ConsoleSink:
    def __init__(self, total_steps: int, print_every: int, first_step: int = 0) -> None:
        self.total = total_steps
        self.print_every = max(1, print_every)
        self.progress = Progress(
            TextColumn("[bold]grpo"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            console=console,
            transient=True,
        )
        self.task = self.progress.add_task("train", total=total_steps, completed=first_step)
        self.progress.start()

    def log(self, step: int, values: dict[str, float]) -> None:
        self.progress.update(self.task, completed=step)
        if step % self.print_every == 0 or step == self.total:
            self.progress.console.print(compact_line(step, self.total, values), soft_wrap=True)

    def close(self) -> None:
        self.progress.stop()


class Tracker:
    def __init__(self, sinks: list[Sink]) -> None:
        self.sinks = sinks

    def log(self, step: int, values: dict[str, float]) -> None:
        for sink in self.sinks:
            sink.log(step, values)

    def log_completions(self, step: int, rows: list[dict[str, Any]]) -> None:
        for sink in self.sinks:
            if isinstance(sink, CompletionsSink):
                sink.log_completions(step, rows)

    def alert(self, title: str, text: str) -> None:
        for sink in self.sinks:
            if isinstance(sink, AlertSink):
                sink.alert(title, text)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
