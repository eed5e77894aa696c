"""The held-out evaluation on the console: a line when a set starts (its problems, greedy and k samples)
and one after every generation batch (problems done of the pass's total, elapsed, an ETA).

A line per batch rather than a live bar: the console of a training run already holds the run's live bar,
and a run's log file keeps every line. Only the main rank prints (the caller decides).
"""

import time
from dataclasses import dataclass, field

from grpo_run.tracking import console


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(round(seconds)), 60)
    return f"{minutes}:{secs:02d}"


@dataclass
class EvalProgress:
    """One held-out set's evaluation: `rows` completions to generate in all (greedy n, sampled n·k);
    the ETA assumes every row takes as long as those done so far."""

    name: str
    problems: int
    rows: int
    done_rows: int = 0
    t0: float = field(default_factory=time.perf_counter)

    @classmethod
    def start(cls, name: str, problems: int, *, k: int, step: int | None) -> "EvalProgress":
        """Say what the evaluation of set `name` will generate (k = 0: greedy only, no gold answers)."""
        each = f"greedy + {k} sampled" if k else "greedy only (no gold answers: no sampled pass@k)"
        when = "" if step is None else f" at step {step}"
        _print(f"held-out evaluation{when}: {name}, {problems} problems, completions: {each}")
        return cls(name, problems, problems * (1 + k))

    def batch_done(self, what: str, done: int, total: int, rows: int) -> None:
        """A generation batch of `rows` completions ended: `done` of the pass's `total` problems."""
        self.done_rows += rows
        elapsed = time.perf_counter() - self.t0
        left = elapsed / self.done_rows * (self.rows - self.done_rows) if self.done_rows else 0.0
        _print(
            f"  eval {self.name} {what}: {done}/{total} problems, {_clock(elapsed)} elapsed, "
            f"eta {_clock(left)}"
        )

    def scored(self) -> None:
        _print(f"  eval {self.name}: {self.problems} problems in {_clock(time.perf_counter() - self.t0)}")


def _print(text: str) -> None:
    console.print(text, soft_wrap=True, markup=False, highlight=False)
