"""Held-out evaluation during a run, wherever it runs, and the step rows that wait for it.

TrainerEvals  the trainer evaluates a due step's weights itself, right after the step (rollout=sync, and
              rollout=async with rollout.eval_on=trainer)
WorkerEvals   rollout=async with rollout.eval_on=worker: the generation worker evaluates them once they
              reach it, while the trainer goes on; their results come one or more steps later
StepLog       logs the step rows in step order, each with its eval/* merged in once they came, so the
              metrics (metrics.jsonl, W&B, the console) have the synchronous loop's rows either way
"""

from typing import Protocol

from grpo_run.config.schema import EvalOn, RolloutMode
from grpo_run.eval_stats import write_problems
from grpo_run.evaluation import evaluate_run
from grpo_run.rollout_source import WorkerEvaluations


class HeldOut(Protocol):
    def start(self, step: int) -> bool:
        """The weights after `step` (0: the start weights) are due for evaluation: evaluate them, now or
        where they go. False: this rank gets no results (rank 0 logs them)."""
        ...

    def results(self, *, wait: bool) -> dict[int, dict[str, float]]:
        """step -> eval/* of the started evaluations that finished since the last call; with wait, of every
        started one. The per-problem results are in the run dir by then."""
        ...


class TrainerEvals:
    """The trainer's own generation engine evaluates its current weights, between steps."""

    def __init__(self, ctx) -> None:
        self.ctx = ctx
        self.done: dict[int, dict[str, float]] = {}

    def start(self, step: int) -> bool:
        self.done[step] = evaluate_run(self.ctx, step)
        return True

    def results(self, *, wait: bool) -> dict[int, dict[str, float]]:
        done, self.done = self.done, {}
        return done


class WorkerEvals:
    """The generation worker evaluates each due version it receives (rollout_worker.Worker.evaluate); on
    the main rank the results come from its source, the other ranks get none."""

    def __init__(self, source: WorkerEvaluations, *, run_dir: str, is_main: bool) -> None:
        self.source, self.run_dir, self.is_main = source, run_dir, is_main
        self.pending: set[int] = set()

    def start(self, step: int) -> bool:
        if self.is_main:
            self.pending.add(step)
        return self.is_main

    def results(self, *, wait: bool) -> dict[int, dict[str, float]]:
        if not self.pending:
            return {}
        came: dict[int, dict[str, float]] = {}
        for step, (values, problems) in self.source.evaluations(set(self.pending), wait=wait).items():
            write_problems(self.run_dir, step, problems)  # for the final paired comparison
            came[step] = values
            self.pending.discard(step)
        return came


def build_held_out(ctx) -> HeldOut:
    """Where the run's held-out evaluations run (`ctx`: the RunContext)."""
    r = ctx.cfg.rollout
    if r.mode == RolloutMode.ASYNC and r.eval_on == EvalOn.WORKER:
        assert isinstance(ctx.rollouts, WorkerEvaluations)
        return WorkerEvals(ctx.rollouts, run_dir=ctx.cfg.run_dir, is_main=ctx.engine.is_main)
    return TrainerEvals(ctx)


class StepLog:
    """Step rows, logged in step order; a row whose weights are being evaluated waits for its eval/*, and
    the rows after it wait behind it (W&B takes steps in order)."""

    def __init__(self, log, held_out: HeldOut, evals: dict[int, dict[str, float]]) -> None:
        """log(step, metrics): the tracker's; evals: step -> eval/*, filled in as they come (the final
        report reads it)."""
        self.log, self.held_out, self.evals = log, held_out, evals
        self.rows: list[tuple[int, dict[str, float], bool]] = []  # (step, metrics, awaits its eval/*)

    def add(self, step: int, metrics: dict[str, float], *, evaluate: bool) -> None:
        """Step `step`'s row; evaluate: its weights are due for a held-out evaluation, which starts now and
        whose eval/* join the row (`metrics`, updated in place)."""
        awaits = self.held_out.start(step) if evaluate else False
        self.rows.append((step, metrics, awaits))
        self.flush(wait=False)

    def flush(self, *, wait: bool) -> None:
        """Log the held rows, oldest first, up to the first whose evaluation has not come; with wait, all of
        them, once every started evaluation came."""
        self.evals.update(self.held_out.results(wait=wait))
        while self.rows:
            step, metrics, awaits = self.rows[0]
            if awaits:
                if step not in self.evals:
                    return
                metrics.update(self.evals[step])
            self.log(step, metrics)
            self.rows.pop(0)

    def abandon(self) -> None:
        """The run ends early: the held rows as they are (their evaluations never came)."""
        for step, metrics, _ in self.rows:
            if metrics:
                self.log(step, metrics)
        self.rows.clear()
