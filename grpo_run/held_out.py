"""Held-out evaluation during a run, wherever it runs, and the step rows that wait for it.

TrainerEvals  the trainer evaluates a due step's weights itself, right after the step (rollout=sync, and
              rollout=async with rollout.eval_on=trainer)
WorkerEvals   rollout=async with rollout.eval_on=worker|shared: the generation worker evaluates them once
              it has them, while the trainer goes on; their results come one or more steps later. Under
              shared the trainer evaluates the first half of those it would wait for itself, at once
StepLog       logs the step rows in step order, each with its eval/* merged in once they came, so the
              metrics (metrics.jsonl, W&B, the console) have the synchronous loop's rows either way
"""

from typing import Protocol

from grpo_run.config.schema import EvalOn, RolloutMode
from grpo_run.eval_stats import write_problems
from grpo_run.evaluation import (
    SetResult,
    evaluate_run,
    evaluate_share,
    held_out_sets,
    merge_shares,
    set_sizes,
    shared_steps,
    summarize_sets,
    trainer_share,
)
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
    the main rank the results come from its source, the other ranks get none. The steps in `shared` the
    trainer splits with it (evaluation.shared_steps): it evaluates its share when the step's evaluation
    starts, with its own engine, while the worker evaluates the rest."""

    def __init__(self, ctx, source: WorkerEvaluations, shared: list[int]) -> None:
        self.ctx, self.source, self.shared = ctx, source, set(shared)
        self.run_dir, self.is_main = ctx.cfg.run_dir, ctx.engine.is_main
        self.sets = held_out_sets(ctx.cfg, ctx.eval_examples, ctx.extra_eval_sets)
        self.pending: set[int] = set()
        self.own: dict[int, dict[str, SetResult]] = {}  # step -> the trainer's share of it

    def start(self, step: int) -> bool:
        if not self.is_main:
            return False
        self.pending.add(step)
        if step in self.shared:
            ctx = self.ctx
            share = trainer_share(set_sizes(self.sets), ctx.cfg.eval.batch_size)[0]
            self.own[step] = evaluate_share(
                self.sets, share, ctx.tokenizer, ctx.rewards.pool, ctx.device, ctx.generation, ctx.environment
            )
        return True

    def results(self, *, wait: bool) -> dict[int, dict[str, float]]:
        if not self.pending:
            return {}
        came: dict[int, dict[str, float]] = {}
        tools = self.ctx.environment is not None
        for step, theirs in self.source.evaluations(set(self.pending), wait=wait).items():
            results = merge_shares(self.own.pop(step, {}), theirs)
            values, problems = summarize_sets(self.sets, results, tools=tools)
            write_problems(self.run_dir, step, problems)  # for the final paired comparison
            came[step] = values
            self.pending.discard(step)
        return came


def build_held_out(ctx, start: int) -> HeldOut:
    """Where the run's held-out evaluations run (`ctx`: the RunContext; `start`: the last step trained
    before this process, 0 for a fresh run)."""
    r = ctx.cfg.rollout
    if r.mode == RolloutMode.ASYNC and r.eval_on != EvalOn.TRAINER:
        assert isinstance(ctx.rollouts, WorkerEvaluations)
        return WorkerEvals(ctx, ctx.rollouts, shared_steps(ctx.cfg, start, ctx.engine.world_size))
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
