"""The GRPO loop, read top to bottom.

One step: sample B prompts → G completions each → rewards [B, G] → group-relative advantages →
old and reference log-probs → μ passes of micro-batched policy-gradient updates → metrics.
The stages live in `rollout/groups.py` (prompts → scored groups) and `update.py` (scored groups →
training batch → optimizer steps); the models behind them are reached through two protocols only:
`ctx.generation` (a GenerationEngine) and `ctx.forward` (a TrainingForward). `ctx` (a RunContext)
holds the run's built parts and is only read; `state` (a LoopState) is what the loop changes as it runs.
"""

import math
import signal
import time
from pathlib import Path

from grpo_run import checkpoint
from grpo_run import metrics as M
from grpo_run.algo import EntropyControl, adaptive_beta, next_entropy_coef
from grpo_run.config.schema import Config, GrpoConfig, KLControlConfig, KLControlKind
from grpo_run.engine.device import peak_memory_gb
from grpo_run.engine.launch import is_main_process
from grpo_run.evaluation.held_out import evaluate_run, is_due, logged_evals
from grpo_run.evaluation.report import report_training
from grpo_run.evaluation.rewards import check_eval_rewards
from grpo_run.loop_state import LoopState
from grpo_run.rollout.engines import ReportsSyncTime
from grpo_run.rollout.groups import ScoredGroups, completion_rows, record_reward_stats, record_tool_free_stats
from grpo_run.rollout.source import RolloutSourceError
from grpo_run.run_context import RunContext, build_context, start_state
from grpo_run.safety import stop
from grpo_run.safety.accounting import account_samples
from grpo_run.safety.signals import LoadingStopped, Preempted, SignalCatcher, request_requeue
from grpo_run.safety.stop import StopRequested, stop_point
from grpo_run.scoring.pool import RewardPoolError
from grpo_run.step_remainder import REMAINDER, Remainder, StepClock, file_contents, load_remainder
from grpo_run.tracking import console
from grpo_run.update import (
    StepCoefs,
    StepInputs,
    TrainingBatch,
    advantages_and_mask,
    anything_to_learn,
    policy_update,
    step_entropy_coef,
    training_batch,
)


def train(cfg: Config) -> dict[str, float]:
    """Run GRPO for `trainer.max_steps` steps; return the last step's metrics."""
    stop.reset()  # a stop requested of an earlier run in this process is not this run's
    # SIGTERM/SIGUSR1 from here on. While the run loads, a stop ends it at once (nothing to save, exit 75);
    # once it is built, every phase ends early, the last trained step is saved, exit 75.
    signals = SignalCatcher(cfg.trainer.stop_within_s, loading=True)
    ctx = built_while_loading(cfg, signals)  # the built parts, read-only from here on
    cfg = ctx.cfg  # a rank started by torchrun/srun now holds rank 0's run dir
    state = start_state(ctx)  # what the loop changes: step, β, streaks, alarms (a checkpoint's, on resume)
    last: dict[str, float] = {}
    # step -> eval/* (held-out accuracy before, during, after); a resumed run starts from those it logged
    evals = logged_evals(cfg.run_dir, state.step) if ctx.resumed is not None else {}
    try:
        # A checkpoint saved between two optimizer steps of step state.step + 1: the rest of that step.
        remainder = resumed_remainder(ctx)
        unlogged = ctx.resumed.unlogged if ctx.resumed is not None else None
        if unlogged is not None:  # a stop cut this step's evaluation short: evaluate again, log it once
            last = {**unlogged, **evaluated(ctx, state, evals, signals, unlogged)}
            ctx.tracker.log(state.step, last)
        if ctx.resumed is None and is_due(cfg.eval, 0, cfg.trainer.max_steps):  # the start weights
            ctx.tracker.log(0, evaluated(ctx, state, evals, signals, {}))
        for step in range(state.step + 1, cfg.trainer.max_steps + 1):
            # The state after step - 1 (RNG and sampler advance while the step samples): what a stop
            # saves when this step's rewards cannot be scored, so a resume repeats the step exactly.
            before = (trainer_state(ctx, state), checkpoint.rng_state())
            try:
                if remainder is not None:  # resumed inside this step: its remaining optimizer steps
                    last, remainder = finish_step(ctx, state, step, remainder), None
                else:
                    last = train_step(ctx, state, step)
            except (RewardPoolError, RolloutSourceError) as err:
                raise save_untrained(ctx, step, before, err) from err
            except StopRequested:  # before the step's first optimizer step: nothing of it is kept
                raise stopped(ctx, before, signals) from None
            except StoppedInStep as inside:  # after one: the state after the last, with the step's rest
                raise stopped_inside(ctx, state, step, inside, signals) from None
            state.step = step
            last.update(state.alarms.observe(step, last))
            if is_due(cfg.eval, step, cfg.trainer.max_steps):
                last.update(evaluated(ctx, state, evals, signals, last))
            ctx.tracker.log(step, last)
            after_step(ctx, state, signals)
        save_final(ctx)
        if ctx.engine.is_main:  # held-out metrics before and after training, and the change
            report_training(cfg, evals, ctx.eval_examples, ctx.extra_eval_sets)
    finally:
        signals.restore()
        ctx.close()
    return last


def built_while_loading(cfg: Config, signals: SignalCatcher) -> RunContext:
    """The run's context, built with the stop signals installed: a stop while it loads ends the run
    (`stopped_loading`), with whatever was built closed and the signal handlers restored."""
    ctx = None
    try:
        signals.install()  # a signal the command kept while it imported is acted on here (exit 75)
        check_eval_rewards(cfg)  # an eval.reward _target_ that does not import: before any model loads
        ctx = build_context(cfg)
        signals.loaded()
    except BaseException as err:
        if ctx is not None:  # the stop came between the build's end and `loaded`
            ctx.close()
        signals.restore()
        if isinstance(err, (LoadingStopped, StopRequested)):
            raise stopped_loading(cfg, signals) from None
        raise
    return ctx


def evaluated(
    ctx: RunContext,
    state: LoopState,
    evals: dict[int, dict[str, float]],
    signals: SignalCatcher,
    unlogged: dict[str, float],
) -> dict[str, float]:
    """eval/* of the weights after `state.step` (0: the start weights), by the trainer's own engine; kept
    in `evals` for the final report.

    A stop cuts the evaluation short and nothing of it is logged: the step is saved with `unlogged`, its
    metrics not yet logged, so that `resume=auto` evaluates it again and logs the step once."""
    try:
        values = evaluate_run(ctx, state.step)
    except StopRequested:
        values = None
    if ctx.engine.broadcast_flag(values is None):  # the ranks stop together, or none does
        if state.step == 0:
            saved = "no step was trained, so nothing was saved: a rerun starts from step 0"
        else:
            newest = checkpoint.newest_position(Path(ctx.cfg.run_dir)) == (state.step, 0)
            if not newest or ctx.resumed is None or ctx.resumed.unlogged is None:
                checkpoint.save(ctx.engine, ctx.cfg, trainer_state(ctx, state, unlogged=unlogged))
            saved = f"step {state.step} is saved, and its evaluation runs again on resume"
        raise preempted(ctx, state.step, signals, saved)
    evals[state.step] = values
    return dict(values)


def train_step(ctx: RunContext, state: LoopState, step: int) -> dict[str, float]:
    """One GRPO step; reads β and the entropy bonus from `state` and writes their next values and the
    non-finite streak."""
    cfg = ctx.cfg
    stats = M.StepMetrics(ctx.device)
    t0 = time.perf_counter()

    # Rollout → scored groups (dynamic sampling may take several rounds): sampled here, or ahead of
    # this step by another process (rollout=async).
    sampled = ctx.rollouts.sample(step, stats)
    stop_point(ctx.engine.broadcast_flag)  # a stop cut the sampling short: nothing of it is trained
    ctx.forward.release_memory()  # the decode loop's caches are gone: their pages go back before the update
    record_reward_stats(stats, sampled.described, ctx.rewards.bounds)
    record_tool_free_stats(stats, sampled.described)  # env.tool_free_share > 0 only
    # This step's entropy bonus: grpo.entropy_coef, or the adaptive controller's.
    entropy_coef = step_entropy_coef(cfg.grpo, state.entropy_coef, state.last_entropy)
    batch = None
    if sampled.groups is not None:
        batch = batch_of_step(ctx, state, step, sampled.groups, stats, entropy_coef)
    t_ref = time.perf_counter()

    # No batch (every group had equal rewards, or every completion was masked as truncated):
    # skip the update, still log the step.
    stop_point(ctx.engine.broadcast_flag)  # after the old/reference forward passes, before any update
    clock = StepClock(t0, t_ref, sampled.generate_s, sampled.tokens)
    return update_step(ctx, state, step, stats, batch, entropy_coef, clock, done=0)


def batch_of_step(
    ctx: RunContext,
    state: LoopState,
    step: int,
    groups: ScoredGroups,
    stats: M.StepMetrics,
    entropy_coef: float,
) -> TrainingBatch | None:
    """Scored groups → training batch: the advantages and loss mask, then the rows that can move the
    weights with π_old and π_ref (and the teacher's log-probs when distilling); None when nothing can."""
    cfg = ctx.cfg
    advantages, mask = advantages_and_mask(cfg.grpo, groups, stats, reward=cfg.reward)
    if not anything_to_learn(ctx.engine, mask, mask_truncated=cfg.grpo.mask_truncated):
        return None
    log_completions(ctx, step, groups, advantages)
    coefs = StepCoefs(state.beta, entropy_coef)
    inputs = StepInputs(groups.rollout, advantages, mask, groups.examples)
    return training_batch(inputs, stats, ctx.update_settings(), ctx.update_models(), coefs)


class StoppedInStep(Exception):
    """A stop between two optimizer steps of a step (grpo.num_iterations > 1): `remainder` is what the
    rest of the step needs, `rng` every generator's state right after its last optimizer step."""

    def __init__(self, remainder: Remainder, rng: dict) -> None:
        super().__init__(f"stopped after {remainder.iterations_done} optimizer step(s) of the step")
        self.remainder, self.rng = remainder, rng


def finish_step(ctx: RunContext, state: LoopState, step: int, remainder: Remainder) -> dict[str, float]:
    """Step `step` resumed from a checkpoint saved after its first `remainder.iterations_done` optimizer
    steps: the rest of its passes over the saved batch, on top of the metrics it had accumulated, so the
    step is logged once with the values the uninterrupted run logs (perf/* count both processes' time)."""
    stats = M.StepMetrics(ctx.device)
    stats.merge(remainder.metrics)
    clock = StepClock.resumed(time.perf_counter(), remainder.seconds)
    done = remainder.iterations_done
    return update_step(ctx, state, step, stats, remainder.batch, remainder.entropy_coef, clock, done=done)


def update_step(
    ctx: RunContext,
    state: LoopState,
    step: int,
    stats: M.StepMetrics,
    batch: TrainingBatch | None,
    entropy_coef: float,
    clock: StepClock,
    *,
    done: int,
) -> dict[str, float]:
    """The step's optimizer steps from pass `done` on (grpo.num_iterations passes over `batch`, none
    without one), then its metrics; writes the controllers' next values and the non-finite streak.

    A stop is honoured between the micro-batches of every pass. In the first, nothing of the step is
    applied yet (StopRequested: the state before the step is saved). In a later one the pass is dropped
    and the state after the last optimizer step is kept (StoppedInStep, with the step's rest)."""
    cfg = ctx.cfg
    for iteration in range(done, cfg.grpo.num_iterations if batch is not None else 0):
        # What a stop in this pass goes back to: taken before its first forward pass (dropout draws).
        rest = None if iteration == 0 else after_optimizer_steps(stats, batch, entropy_coef, clock, iteration)
        rng = None if rest is None else checkpoint.rng_state()
        try:
            coefs = StepCoefs(state.beta, entropy_coef)
            skipped = policy_update(batch, stats, ctx.update_settings(), ctx.update_models(), coefs)
        except StopRequested:
            if rest is None:
                raise
            raise StoppedInStep(rest, rng) from None
        ctx.generation.policy_updated()  # the next generate samples from the new weights
        state.nonfinite_streak = state.nonfinite_streak + 1 if skipped else 0
    ctx.rollouts.trained(step, stats)  # rollout=async: the new weights go to the generation worker
    ctx.forward.release_memory()
    record_step_host_values(ctx, state, stats, clock, time.perf_counter())
    metrics = stats.reduce(ctx.engine)
    account_samples(step, metrics)  # every scored completion trained or counted as dropped, or stop
    advance_controllers(cfg, state, metrics)
    return metrics


def record_step_host_values(
    ctx: RunContext, state: LoopState, stats: M.StepMetrics, clock: StepClock, t_end: float
) -> None:
    """The step's host-side values: the lr, the β its loss used, its timings, peak memory, the weight sync."""
    stats.set_host(M.LR, ctx.engine.current_lr())
    stats.set_host(M.BETA, state.beta)  # the β this step's loss used
    stats.set_host(M.STEP_S, t_end - clock.t0)
    stats.set_host(M.GENERATE_S, clock.generate_s)
    # Scoring and the old/reference forward passes: everything between generation and the update.
    stats.set_host(M.REFERENCE_S, clock.t_ref - clock.t0 - clock.generate_s)
    stats.set_host(M.TRAIN_S, t_end - clock.t_ref)
    stats.add_sum(M.TOKENS_PER_S, clock.tokens / (t_end - clock.t0))
    stats.set_host(M.PEAK_MEM_GB, peak_memory_gb(ctx.device))
    if isinstance(ctx.generation, ReportsSyncTime):  # generation=vllm
        stats.set_host(M.WEIGHT_SYNC_S, ctx.generation.take_sync_seconds())


def advance_controllers(cfg: Config, state: LoopState, metrics: dict[str, float]) -> None:
    """From the step's reduced metrics: the next step's β and entropy bonus, and the unscored streak."""
    completions = cfg.trainer.prompts_per_step * cfg.grpo.group_size
    state.beta = control_beta(state.beta, metrics, cfg.kl_control, completions=completions)
    state.entropy_coef, state.last_entropy = control_entropy(
        state.entropy_coef, state.last_entropy, metrics, cfg.grpo
    )
    # A step whose every completion went unscored by every reward function trained on nothing.
    unscored = metrics.get(M.REWARD_FAILED_FRACTION, 0.0) >= 1.0 - 1e-9
    state.reward_failed_streak = state.reward_failed_streak + 1 if unscored else 0


def after_optimizer_steps(
    stats: M.StepMetrics, batch: TrainingBatch, entropy_coef: float, clock: StepClock, done: int
) -> Remainder:
    """The step's rest after `done` optimizer steps: its batch, its metrics so far (the accumulators are
    replaced, never changed in place, so shallow copies keep today's values) and its timings."""
    metrics = tuple(dict(part) for part in stats.parts())
    return Remainder(batch, entropy_coef, done, metrics, clock.elapsed(time.perf_counter()))


def resumed_remainder(ctx: RunContext) -> Remainder | None:
    """This rank's rest of the step a checkpoint was saved inside (None: it holds a whole step)."""
    if ctx.resumed is None or ctx.resumed.iterations_done == 0:
        return None
    assert ctx.resumed_from is not None
    return load_remainder(ctx.resumed_from, ctx.engine.rank, ctx.device)


def log_completions(ctx: RunContext, step: int, groups, advantages) -> None:
    every = ctx.cfg.logger.log_completions_every
    if every > 0 and step % every == 0 and ctx.engine.is_main:
        ctx.tracker.log_completions(step, completion_rows(ctx.tokenizer, groups, advantages, step))


def control_beta(beta: float, metrics: dict[str, float], kc: KLControlConfig, *, completions: int) -> float:
    """The next step's β. kl_control=adaptive steers β towards the target KL from the step's measured KL
    (already on host); fixed leaves it.

    PPO's controller (Ziegler et al. 2019) counts samples: one step moves β by at most
    ±20% · completions / horizon (completions: B·G of the step). A step without an update measured no
    KL and leaves β alone.
    """
    if kc.kind != KLControlKind.ADAPTIVE or M.KL not in metrics:
        return beta
    return float(
        adaptive_beta(beta, metrics[M.KL], target=kc.target, horizon=kc.horizon, n_steps=completions)
    )


def control_entropy(
    coef: float, last_entropy: float, metrics: dict[str, float], grpo: GrpoConfig
) -> tuple[float, float]:
    """The next step's (coefficient, last entropy). grpo.entropy_control=adaptive (Skywork-OR1) steps the
    entropy bonus's coefficient by the step's measured train/entropy (already on host); fixed leaves
    both. A step without an update measured no entropy and changes nothing."""
    if grpo.entropy_control != EntropyControl.ADAPTIVE or M.ENTROPY not in metrics:
        return coef, last_entropy
    entropy = metrics[M.ENTROPY]
    coef = next_entropy_coef(
        coef,
        entropy,
        target=grpo.entropy_target,
        delta=grpo.entropy_coef_delta,
        low=grpo.entropy_coef_min,
        high=grpo.entropy_coef_max,
    )
    return float(coef), float(entropy)


class NonFiniteError(RuntimeError):
    """Too many optimizer updates in a row were skipped for a non-finite loss or gradient."""


class RewardsFailed(RuntimeError):
    """reward.max_failed_steps steps in a row on which no reward function scored any completion: the
    reward is broken (it raises, times out or returns None everywhere), and a run on it trains nothing."""


def after_step(ctx: RunContext, state: LoopState, signals: SignalCatcher) -> None:
    """Stop on a run of NaN updates; checkpoint when due; on SIGTERM/SIGUSR1 save, then raise Preempted."""
    t, step = ctx.cfg.trainer, state.step
    if state.nonfinite_streak >= t.max_consecutive_nonfinite:
        raise NonFiniteError(
            f"step {step}: {state.nonfinite_streak} optimizer updates in a row skipped for a non-finite "
            f"loss or gradient (trainer.max_consecutive_nonfinite={t.max_consecutive_nonfinite}); "
            f"{checkpoint.describe_saved(Path(ctx.cfg.run_dir))}"
        )
    failed_steps = ctx.cfg.reward.max_failed_steps
    if failed_steps and state.reward_failed_streak >= failed_steps:
        raise RewardsFailed(
            f"step {step}: no reward function scored any completion for {state.reward_failed_streak} steps "
            f"in a row (every call raised, timed out or returned None; reward.max_failed_steps={failed_steps})"
            f": fix the reward (its first traceback is printed above); "
            f"{checkpoint.describe_saved(Path(ctx.cfg.run_dir))}"
        )
    # One collective: a rank that got no signal still stops with the others, so nobody hangs.
    stop = ctx.engine.broadcast_flag(signals.received)
    if stop or checkpoint.is_due(ctx.cfg.checkpoint, step, t.max_steps):
        checkpoint.save(ctx.engine, ctx.cfg, trainer_state(ctx, state))
    if stop:
        raise preempted(ctx, step, signals, "checkpoint saved")


def preempted(ctx: RunContext, step: int, signals: SignalCatcher, saved: str) -> Preempted:
    """The exception that ends a stopped run (exit 75), after the Slurm requeue when asked for."""
    signum = signals.signum or signal.SIGTERM  # ranks that got no signal stop for the one that did
    requeued = ctx.engine.is_main and request_requeue(signum, ctx.cfg.checkpoint.slurm_requeue)
    return Preempted(step, signum, requeued, saved)


def stopped_loading(cfg: Config, signals: SignalCatcher) -> Preempted:
    """A stop while the run was still loading: nothing was trained in this process, nothing is saved."""
    signum = signals.signum or signal.SIGTERM
    requeued = is_main_process() and request_requeue(signum, cfg.checkpoint.slurm_requeue)
    step = checkpoint.newest_step(Path(cfg.run_dir)) or 0
    if step:
        saved = f"the run was still loading, so nothing new was saved: a resume continues from step {step}"
    else:
        saved = "the run was still loading and no step was trained, so nothing was saved: a rerun starts from step 0"
    return Preempted(step, signum, requeued, saved)


def stopped(ctx: RunContext, before, signals: SignalCatcher) -> Preempted:
    """A stop during a step, before its first optimizer step: the state before it is the run's last."""
    state, rng = before
    return preempted(ctx, state.step, signals, save_before(ctx, state, rng))


class ScoringFailed(RuntimeError):
    """A step's groups could not be scored (the reward workers kept dying) or never came (their source
    failed, e.g. the generation worker of rollout=async died): it was not trained, and the state before
    it is saved."""


def stopped_inside(
    ctx: RunContext, state: LoopState, step: int, inside: StoppedInStep, signals: SignalCatcher
) -> Preempted:
    """A stop between two optimizer steps of `step`: the state after the last one is saved with the step's
    rest beside it (unless it is the newest checkpoint already: a resumed step stopped again before its
    next optimizer step), so that resume=auto runs the remaining passes."""
    rest = inside.remainder
    saved = trainer_state(ctx, state, iterations_done=rest.iterations_done)
    run_dir = Path(ctx.cfg.run_dir)
    if checkpoint.newest_position(run_dir) != (state.step, rest.iterations_done):
        own = {REMAINDER.format(rank=ctx.engine.rank): file_contents(rest)}
        checkpoint.save(ctx.engine, ctx.cfg, saved, rng=inside.rng, rank_files=own)
    folder = run_dir / checkpoint.CHECKPOINTS / checkpoint.folder_name(saved)
    mu = ctx.cfg.grpo.num_iterations
    return preempted(
        ctx,
        state.step,
        signals,
        f"the state after {rest.iterations_done} of step {step}'s {mu} optimizer steps, {folder}, is saved",
    )


def save_untrained(
    ctx: RunContext, step: int, before, err: RewardPoolError | RolloutSourceError
) -> ScoringFailed:
    """Save the last trained step's state (unless it is the newest checkpoint already, or nothing was
    trained yet: a rerun from step 0 repeats everything); return the error that ends the run."""
    state, rng = before
    if ctx.engine.is_main:
        console.print(err.detail, style="red", soft_wrap=True, markup=False, highlight=False)
    saved = save_before(ctx, state, rng)
    return ScoringFailed(f"step {step} was not trained: {err}; {saved}; resume with resume=auto")


def save_before(ctx: RunContext, state: checkpoint.TrainerState, rng) -> str:
    """Save `state`, the last trained step's (unless it is the newest checkpoint already, or nothing was
    trained yet); say what was saved. The advice to resume is the caller's: the command line's
    (`entry.py`) names the run folder on a stop."""
    run_dir = Path(ctx.cfg.run_dir)
    if state.step == 0:
        return "no step was trained, so nothing was saved: a rerun starts from step 0"
    if checkpoint.newest_position(run_dir) != (state.step, 0):
        checkpoint.save(ctx.engine, ctx.cfg, state, rng=rng)
    folder = run_dir / checkpoint.CHECKPOINTS / checkpoint.step_name(state.step)
    return f"the last good state, {folder} (step {state.step}), is saved"


def save_final(ctx: RunContext) -> None:
    """The trained policy and its tokenizer as a transformers folder (safetensors) in the run dir; with
    LoRA, PEFT's adapter folder (and final/merged with lora.save_merged)."""
    if ctx.engine.is_main:
        final = Path(ctx.cfg.run_dir) / "final"
        if ctx.lora is not None:
            ctx.lora.save(final, ctx.tokenizer, merged=ctx.cfg.lora.save_merged)
            return
        ctx.policy.save_pretrained(final)
        ctx.tokenizer.save_pretrained(final)


def trainer_state(
    ctx: RunContext, state: LoopState, unlogged: dict[str, float] | None = None, iterations_done: int = 0
) -> checkpoint.TrainerState:
    """What the loop needs to continue after `state.step`, beside the engine's files (unlogged: the
    step's metrics, when a stop cut its evaluation short; iterations_done: the optimizer steps of the next
    step already applied, when a stop came between two of them)."""
    return checkpoint.TrainerState(
        step=state.step,
        sampler=ctx.sampler.state_dict(),
        beta=float(state.beta),
        nonfinite_streak=state.nonfinite_streak,
        reward_failed_streak=state.reward_failed_streak,
        world_size=ctx.engine.world_size,
        wandb_run_id=checkpoint.wandb_run_id(ctx.cfg.run_dir),
        alarms=state.alarms.state_dict(),
        unlogged=None if unlogged is None else {k: float(v) for k, v in unlogged.items()},
        iterations_done=iterations_done,
        **entropy_state(ctx.cfg.grpo, state),
    )


def entropy_state(grpo: GrpoConfig, state: LoopState) -> dict[str, float | None]:
    """The adaptive entropy controller's checkpointed values (None with a fixed coefficient)."""
    if grpo.entropy_control != EntropyControl.ADAPTIVE:
        return {}
    last = None if math.isinf(state.last_entropy) else state.last_entropy
    return {"entropy_coef": float(state.entropy_coef), "last_entropy": last}
