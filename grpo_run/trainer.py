"""The GRPO loop, read top to bottom.

One step: sample B prompts → G completions each → rewards [B, G] → group-relative advantages →
old and reference log-probs → μ passes of micro-batched policy-gradient updates → metrics.
The stages live in `rollout/groups.py` (prompts → scored groups) and `update.py` (scored groups →
training batch → optimizer steps); the models behind them are reached through two protocols only:
`ctx.generation` (a GenerationEngine) and `ctx.forward` (a TrainingForward).
"""

import signal
import time
from pathlib import Path

from grpo_run import checkpoint
from grpo_run import metrics as M
from grpo_run.algo import adaptive_beta
from grpo_run.config.schema import Config, KLControlKind
from grpo_run.engine.device import peak_memory_gb
from grpo_run.evaluation import evaluate_run, is_due, logged_evals, report_run
from grpo_run.preemption import Preempted, SignalCatcher, request_requeue
from grpo_run.rollout.engines import ReportsSyncTime
from grpo_run.rollout.groups import completion_rows, record_reward_stats, sample_groups
from grpo_run.run_context import RunContext, build_context
from grpo_run.scoring.pool import RewardPoolError
from grpo_run.tracking import console
from grpo_run.tracking.alarms import build_alarms
from grpo_run.update import advantages_and_mask, anything_to_learn, policy_update, training_batch


def train(cfg: Config) -> dict[str, float]:
    """Run GRPO for `trainer.max_steps` steps; return the last step's metrics."""
    ctx = build_context(cfg)
    cfg = ctx.cfg  # a rank started by torchrun/srun now holds rank 0's run dir
    signals = SignalCatcher().install()  # SIGTERM/SIGUSR1 from here on: finish the step, save, exit
    last: dict[str, float] = {}
    # step -> eval/* (held-out accuracy before, during, after); a resumed run starts from those it logged
    evals = logged_evals(cfg.run_dir, ctx.start_step) if ctx.start_step else {}
    alarms = ctx.alarms = build_alarms(ctx)  # runs that cannot learn, said while they run
    alarms.load_state_dict(ctx.alarm_state)  # a resumed run continues its streaks
    try:
        if ctx.start_step == 0 and is_due(cfg.eval, 0, cfg.trainer.max_steps):
            evals[0] = evaluate_run(ctx, 0)
            ctx.tracker.log(0, evals[0])
        for step in range(ctx.start_step + 1, cfg.trainer.max_steps + 1):
            # The state after step - 1 (RNG and sampler advance while the step samples): what a stop
            # saves when this step's rewards cannot be scored, so a resume repeats the step exactly.
            before = (trainer_state(ctx, step - 1), checkpoint.rng_state())
            try:
                last = train_step(ctx, step)
            except RewardPoolError as err:
                raise save_untrained(ctx, step, before, err) from err
            last.update(alarms.observe(step, last))
            if is_due(cfg.eval, step, cfg.trainer.max_steps):
                evals[step] = evaluate_run(ctx, step)
                last.update(evals[step])
            ctx.tracker.log(step, last)
            after_step(ctx, step, signals)
        save_final(ctx)
        report_run(ctx, evals)
    finally:
        signals.restore()
        ctx.close()
    return last


def train_step(ctx: RunContext, step: int) -> dict[str, float]:
    cfg = ctx.cfg
    stats = M.StepMetrics(ctx.device)
    t0 = time.perf_counter()

    # Rollout → scored groups (dynamic sampling may take several rounds).
    sampled = sample_groups(ctx, step, stats)
    ctx.forward.release_memory()  # the decode loop's caches are gone: their pages go back before the update
    record_reward_stats(stats, sampled.described, ctx.rewards.bounds)
    batch = None
    if sampled.groups is not None:
        advantages, mask = advantages_and_mask(ctx, sampled.groups, stats)
        if anything_to_learn(ctx, mask):
            log_completions(ctx, step, sampled.groups, advantages)
            # Scored groups → training batch: the rows that can move the weights, with π_old and π_ref.
            batch = training_batch(ctx, sampled.groups.rollout, advantages, mask)
    t_ref = time.perf_counter()

    # No batch (every group had equal rewards, or every completion was masked as truncated):
    # skip the update, still log the step.
    for _ in range(cfg.grpo.num_iterations if batch is not None else 0):
        policy_update(ctx, batch, stats)
    ctx.forward.release_memory()
    t_end = time.perf_counter()

    stats.set_host(M.LR, ctx.engine.current_lr())
    stats.set_host(M.BETA, ctx.beta)  # the β this step's loss used
    stats.set_host(M.STEP_S, t_end - t0)
    stats.set_host(M.GENERATE_S, sampled.generate_s)
    # Scoring and the old/reference forward passes: everything between generation and the update.
    stats.set_host(M.REFERENCE_S, t_ref - t0 - sampled.generate_s)
    stats.set_host(M.TRAIN_S, t_end - t_ref)
    stats.add_sum(M.TOKENS_PER_S, sampled.tokens / (t_end - t0))
    stats.set_host(M.PEAK_MEM_GB, peak_memory_gb(ctx.device))
    if isinstance(ctx.generation, ReportsSyncTime):  # generation=vllm
        stats.set_host(M.WEIGHT_SYNC_S, ctx.generation.take_sync_seconds())
    metrics = stats.reduce(ctx.engine)
    control_beta(ctx, metrics)
    return metrics


def log_completions(ctx: RunContext, step: int, groups, advantages) -> None:
    every = ctx.cfg.logger.log_completions_every
    if every > 0 and step % every == 0 and ctx.engine.is_main:
        ctx.tracker.log_completions(step, completion_rows(ctx.tokenizer, groups, advantages, step))


def control_beta(ctx: RunContext, metrics: dict[str, float]) -> None:
    """kl_control=adaptive: steer β towards the target KL from the step's measured KL (already on host).

    PPO's controller (Ziegler et al. 2019) counts samples: one step moves β by at most
    ±20% · (B·G) / horizon. A step without an update measured no KL and leaves β alone.
    """
    kc = ctx.cfg.kl_control
    if kc.kind != KLControlKind.ADAPTIVE or M.KL not in metrics:
        return
    completions = ctx.cfg.trainer.prompts_per_step * ctx.cfg.grpo.group_size
    ctx.beta = float(
        adaptive_beta(ctx.beta, metrics[M.KL], target=kc.target, horizon=kc.horizon, n_steps=completions)
    )


class NonFiniteError(RuntimeError):
    """Too many optimizer updates in a row were skipped for a non-finite loss or gradient."""


def after_step(ctx: RunContext, step: int, signals: SignalCatcher) -> None:
    """Stop on a run of NaN updates; checkpoint when due; on SIGTERM/SIGUSR1 save, then raise Preempted."""
    t = ctx.cfg.trainer
    if ctx.nonfinite_streak >= t.max_consecutive_nonfinite:
        raise NonFiniteError(
            f"step {step}: {ctx.nonfinite_streak} optimizer updates in a row skipped for a non-finite "
            f"loss or gradient (trainer.max_consecutive_nonfinite={t.max_consecutive_nonfinite}); "
            f"{checkpoint.describe_saved(Path(ctx.cfg.run_dir))}"
        )
    # One collective: a rank that got no signal still stops with the others, so nobody hangs.
    stop = ctx.engine.broadcast_flag(signals.received)
    if stop or checkpoint.is_due(ctx.cfg.checkpoint, step, t.max_steps):
        checkpoint.save(ctx.engine, ctx.cfg, trainer_state(ctx, step))
    if stop:
        signum = signals.signum or signal.SIGTERM  # ranks that got no signal stop for the one that did
        requeued = ctx.engine.is_main and request_requeue(signum, ctx.cfg.checkpoint.slurm_requeue)
        raise Preempted(step, signum, requeued)


class ScoringFailed(RuntimeError):
    """A step's rewards could not be scored (the reward workers kept dying): it was not trained, and the
    state before it is saved."""


def save_untrained(ctx: RunContext, step: int, before, err: RewardPoolError) -> ScoringFailed:
    """Save the last trained step's state (unless it is the newest checkpoint already, or nothing was
    trained yet: a rerun from step 0 repeats everything); return the error that ends the run."""
    state, rng = before
    run_dir = Path(ctx.cfg.run_dir)
    if ctx.engine.is_main:
        console.print(err.detail, style="red", soft_wrap=True, markup=False, highlight=False)
    if state.step == 0:
        saved = "no step was trained, so nothing was saved: a rerun starts from step 0"
    else:
        if checkpoint.newest_step(run_dir) != state.step:
            checkpoint.save(ctx.engine, ctx.cfg, state, rng=rng)
        folder = run_dir / checkpoint.CHECKPOINTS / checkpoint.step_name(state.step)
        saved = f"the last good state, {folder} (step {state.step}), is saved; resume with resume=auto"
    return ScoringFailed(f"step {step} was not trained: {err}; {saved}")


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


def trainer_state(ctx: RunContext, step: int) -> checkpoint.TrainerState:
    """What the loop itself needs to continue after `step`, beside the engine's files."""
    return checkpoint.TrainerState(
        step=step,
        sampler=ctx.sampler.state_dict(),
        beta=float(ctx.beta),
        nonfinite_streak=ctx.nonfinite_streak,
        world_size=ctx.engine.world_size,
        wandb_run_id=checkpoint.wandb_run_id(ctx.cfg.run_dir),
        alarms=ctx.alarms.state_dict() if ctx.alarms is not None else {},
    )
