"""The GRPO loop, read top to bottom.

One step: sample B prompts → G completions each → rewards [B, G] → group-relative advantages →
old and reference log-probs → μ passes of micro-batched policy-gradient updates → metrics.
"""

import contextlib
import signal
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import NamedTuple

import torch

from grpo_run import checkpoint
from grpo_run import metrics as M
from grpo_run.algo import (
    Aggregation,
    adaptive_beta,
    compute_advantages,
    masked_mean,
    policy_loss,
    zero_std_groups,
)
from grpo_run.config.schema import Config, KLControlKind
from grpo_run.evaluation import evaluate_run, is_due, logged_evals, report_run
from grpo_run.heap import MIN_FREE_BYTES, release_free_memory
from grpo_run.models.forward import completion_logprobs, trim_columns
from grpo_run.models.sampling_copy import wants_bf16_copy
from grpo_run.models.weight_casts import WeightCasts
from grpo_run.preemption import Preempted, SignalCatcher, request_requeue
from grpo_run.rewards.scoring import ScoreResult
from grpo_run.rollout.filtering import (
    concat_rollouts,
    group_rows,
    informative_groups,
    loss_mask,
    rows_with_gradient,
    take_rows,
)
from grpo_run.rollout.generate import Rollout, SamplingParams, generate_group_completions, group_seed
from grpo_run.run_context import RunContext, build_context, peak_memory_gb


@dataclass
class StepBatch:
    """Everything the update needs about one step's groups (row b·G + g is completion g of group b)."""

    examples: list  # [B] the prompts of the groups, in row order
    rollout: Rollout
    rewards: torch.Tensor  # [B, G]
    valid: torch.Tensor  # [B, G] bool: scorable
    scores: ScoreResult  # per-function values of these rows (error counts were logged per round)
    advantages: torch.Tensor | None = None  # [N]
    loss_mask: torch.Tensor | None = None  # [N, T] float: completion mask, minus what mask_truncated drops
    old_logprobs: torch.Tensor | None = None  # [N, T], None when μ = 1 (the detached current ones are used)
    ref_logprobs: torch.Tensor | None = None  # [N, T], None when β = 0
    normalizer: torch.Tensor | None = None  # [] the loss denominator of the whole step, every rank
    skipped_loss_tokens: torch.Tensor | float = 0.0  # [] loss tokens of rows left out of the update


class Sampled(NamedTuple):
    batch: StepBatch | None  # None: dynamic sampling found no group with a learning signal
    generate_s: float  # seconds spent generating, every round
    tokens: torch.Tensor  # [] prompt + completion tokens of every round


def train(cfg: Config) -> dict[str, float]:
    """Run GRPO for `trainer.max_steps` steps; return the last step's metrics."""
    ctx = build_context(cfg)
    cfg = ctx.cfg  # a rank started by torchrun/srun now holds rank 0's run dir
    signals = SignalCatcher().install()  # SIGTERM/SIGUSR1 from here on: finish the step, save, exit
    last: dict[str, float] = {}
    # step -> eval/* (held-out accuracy before, during, after); a resumed run starts from those it logged
    evals = logged_evals(cfg.run_dir, ctx.start_step) if ctx.start_step else {}
    try:
        if ctx.start_step == 0 and is_due(cfg.eval, 0, cfg.trainer.max_steps):
            evals[0] = evaluate_run(ctx)
            ctx.tracker.log(0, evals[0])
        for step in range(ctx.start_step + 1, cfg.trainer.max_steps + 1):
            last = train_step(ctx, step)
            if is_due(cfg.eval, step, cfg.trainer.max_steps):
                evals[step] = evaluate_run(ctx)
                last.update(evals[step])
            ctx.tracker.log(step, last)
            after_step(ctx, step, signals)
        save_final(ctx)
        report_run(ctx, evals)
    finally:
        signals.restore()
        ctx.close()
    return last


class NonFiniteError(RuntimeError):
    """Too many optimizer updates in a row were skipped for a non-finite loss or gradient."""


def after_step(ctx: RunContext, step: int, signals: SignalCatcher) -> None:
    """Stop on a run of NaN updates; checkpoint when due; on SIGTERM/SIGUSR1 save, then raise Preempted."""
    t = ctx.cfg.trainer
    if ctx.nonfinite_streak >= t.max_consecutive_nonfinite:
        raise NonFiniteError(
            f"step {step}: {ctx.nonfinite_streak} optimizer updates in a row skipped for a non-finite "
            f"loss or gradient (trainer.max_consecutive_nonfinite={t.max_consecutive_nonfinite}); "
            f"the last checkpoint holds finite weights"
        )
    # One collective: a rank that got no signal still stops with the others, so nobody hangs.
    stop = ctx.engine.broadcast_flag(signals.received)
    if stop or checkpoint.is_due(ctx.cfg.checkpoint, step, t.max_steps):
        checkpoint.save(ctx, step)
    if stop:
        signum = signals.signum or signal.SIGTERM  # ranks that got no signal stop for the one that did
        requeued = ctx.engine.is_main and request_requeue(signum, ctx.cfg.checkpoint.slurm_requeue)
        raise Preempted(step, signum, requeued)


def save_final(ctx: RunContext) -> None:
    """The trained policy and its tokenizer as a transformers folder (safetensors) in the run dir."""
    if ctx.engine.is_main:
        final = Path(ctx.cfg.run_dir) / "final"
        ctx.policy.save_pretrained(final)
        ctx.tokenizer.save_pretrained(final)


def train_step(ctx: RunContext, step: int) -> dict[str, float]:
    cfg = ctx.cfg
    stats = M.StepMetrics(ctx.device)
    t0 = time.perf_counter()

    sampled = sample_and_score(ctx, step, stats)
    batch = sampled.batch
    trim_heap(ctx)  # the decode loop's KV caches are gone: their pages go back before the update
    every = cfg.logger.log_completions_every
    if batch is not None and every > 0 and step % every == 0 and ctx.engine.is_main:
        ctx.tracker.log_completions(step, completion_rows(ctx, batch.examples, batch, step))
    if batch is not None:
        batch = rows_to_train(ctx, batch)
        batch.old_logprobs, batch.ref_logprobs = old_and_reference_logprobs(ctx, batch.rollout)
    t_ref = time.perf_counter()

    # No batch (every group had equal rewards, or every completion was masked as truncated):
    # skip the update, still log the step.
    for _ in range(cfg.grpo.num_iterations if batch is not None else 0):
        update(ctx, batch, stats)
    trim_heap(ctx)
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
    metrics = stats.reduce(ctx.engine)
    control_beta(ctx, metrics)
    return metrics


def trim_heap(ctx: RunContext) -> None:
    if ctx.cfg.trainer.release_free_memory:
        release_free_memory(MIN_FREE_BYTES)  # a few MB free would only fault straight back in


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


def rank_share(ctx: RunContext, examples: list) -> list:
    """This rank's contiguous B/world prompts: every rank draws the same B, whole groups stay on one rank."""
    share = len(examples) // ctx.engine.world_size
    return examples[ctx.engine.rank * share : (ctx.engine.rank + 1) * share]


def generate(ctx: RunContext, questions: list[str], step: int, round_index: int = 0) -> Rollout:
    """G completions for each prompt; each group's noise is seeded by (seed, step, prompt index).

    round_index: the generation round within the step (dynamic sampling); every (round, step, prompt)
    gets its own index, and round 0 keeps the indices of a run without resampling.
    """
    cfg = ctx.cfg
    enc = ctx.tokenizer(
        ctx.format_prompts(questions), return_tensors="pt", padding=True, add_special_tokens=False
    )
    # Global prompt index (this rank's share starts at rank * share): samples match a one-process run.
    first_index = (step - 1) * cfg.trainer.prompts_per_step + ctx.engine.rank * len(questions)
    first_index += round_index * cfg.trainer.max_steps * cfg.trainer.prompts_per_step
    seeds = [group_seed(cfg.trainer.seed, step, first_index + i) for i in range(len(questions))]
    params = SamplingParams(
        max_new_tokens=cfg.generation.max_new_tokens,
        temperature=cfg.generation.temperature,
        top_p=cfg.generation.top_p,
        top_k=cfg.generation.top_k,
    )
    model = ctx.sampling.model()  # the policy, or its bf16 copy rebuilt from it (freed again below)
    model.eval()
    with ctx.autocast() if not ctx.sampling.is_copy else contextlib.nullcontext():
        rollout = generate_group_completions(
            model,
            enc.input_ids.to(ctx.device),
            enc.attention_mask.to(ctx.device),
            group_size=cfg.grpo.group_size,
            params=params,
            eos_id=ctx.tokenizer.eos_token_id,
            pad_id=ctx.tokenizer.pad_token_id,
            seeds=seeds,
            backend=cfg.generation.backend,
        )
    ctx.sampling.release()
    ctx.policy.train()
    return rollout


def sample_and_score(ctx: RunContext, step: int, stats: M.StepMetrics) -> Sampled:
    """The step's scored groups with their advantages and loss mask (None: nothing to learn from).

    Reward statistics describe the groups that reach the update (all generated ones when none does).
    """
    g = ctx.cfg.grpo
    kept, scored, generate_s, tokens = sample_rounds(ctx, step, stats)
    batch = concat_batches(kept or scored, ctx.tokenizer.pad_token_id)
    record_reward_stats(ctx, stats, batch)
    if not kept:
        return Sampled(None, generate_s, tokens)
    batch.advantages = compute_advantages(
        batch.rewards, g.advantage_mode, g.std_correction, g.advantage_eps, valid=batch.valid
    ).reshape(-1)  # [N]; normalized_batch: σ over every reward of the step's update (this process's)
    batch.loss_mask = loss_mask(batch.rollout, g.mask_truncated)  # [N, T]
    stats.add_sum(M.MASKED_TRUNCATED, batch.rollout.truncated.sum() if g.mask_truncated else 0)
    # Every completion truncated and masked: nothing to learn from, and an optimizer step on a zero
    # gradient would still move the weights by Adam's momentum. One sync, agreed by every rank.
    if g.mask_truncated and not ctx.engine.all_reduce_sum(batch.loss_mask.sum()).item():
        return Sampled(None, generate_s, tokens)
    return Sampled(batch, generate_s, tokens)


def sample_rounds(ctx: RunContext, step: int, stats: M.StepMetrics):
    """Generation rounds of B prompts → (kept batches, every scored batch, generate seconds, tokens).

    One round; with grpo.filter_zero_std (DAPO's dynamic sampling) groups whose rewards are all equal
    are dropped and new prompts sampled, at most grpo.max_resample_rounds rounds, until B informative
    groups are kept (fewer when the bound is hit). Surplus informative groups of the last round are
    discarded.
    """
    g = ctx.cfg.grpo
    scored: list[StepBatch] = []
    kept: list[StepBatch] = []
    generate_s, tokens, dropped = 0.0, torch.zeros((), device=ctx.device), torch.zeros((), device=ctx.device)
    for round_index in range(g.max_resample_rounds if g.filter_zero_std else 1):
        examples = rank_share(ctx, ctx.sampler.next_batch())
        t = time.perf_counter()
        rollout = generate(ctx, [e.question for e in examples], step, round_index)
        generate_s += time.perf_counter() - t
        tokens = tokens + rollout.completion_mask.sum() + rollout.prompt_mask.sum()
        batch = score(ctx, examples, rollout, stats)
        scored.append(batch)
        if not g.filter_zero_std:
            kept.append(batch)
            break
        zero_std = zero_std_groups(batch.rewards, valid=batch.valid)  # [B]
        dropped = dropped + zero_std.sum()
        need = len(examples) - sum(len(k.examples) for k in kept)
        groups = informative_groups(zero_std, need)
        if groups:
            kept.append(select_groups(batch, groups, g.group_size))
        if len(groups) == need:
            break
    stats.add_sum(M.DROPPED_GROUPS, dropped)
    stats.add_max(M.GENERATION_ROUNDS, len(scored))
    return kept, scored, generate_s, tokens


def score(ctx: RunContext, examples, rollout: Rollout, stats: M.StepMetrics) -> StepBatch:
    """Rewards [B, G] for the decoded completions of one round; reward failures are counted here."""
    g = ctx.cfg.grpo.group_size
    completions = ctx.tokenizer.batch_decode(rollout.completion_ids, skip_special_tokens=True)
    prompts = [e.question for e in examples for _ in range(g)]
    answers = [e.answer for e in examples for _ in range(g)]
    scores = ctx.score(prompts, completions, answers, rollout.completion_lengths.tolist())
    ctx.report_reward_errors(scores)
    stats.add_sum(M.REWARD_ERRORS, scores.errors)
    stats.add_sum(M.REWARD_TIMEOUTS, scores.timeouts)
    stats.add_sum(M.REWARD_UNSCORABLE, scores.unscorable)

    valid = torch.tensor([r is not None for r in scores.total], device=ctx.device).view(-1, g)  # [B, G]
    rewards = torch.tensor([0.0 if r is None else r for r in scores.total], device=ctx.device).view(-1, g)
    return StepBatch(list(examples), rollout, rewards, valid, scores)


def select_groups(batch: StepBatch, groups: list[int], group_size: int) -> StepBatch:
    """The scored batch restricted to whole groups, in the order given."""
    rows = group_rows(groups, group_size)
    index = torch.tensor(groups, dtype=torch.long, device=batch.rewards.device)  # [k]
    scores = ScoreResult(
        total=[batch.scores.total[i] for i in rows],
        per_function={name: [v[i] for i in rows] for name, v in batch.scores.per_function.items()},
    )
    examples = [batch.examples[i] for i in groups]
    rollout = take_rows(batch.rollout, rows)
    return StepBatch(examples, rollout, batch.rewards[index], batch.valid[index], scores)


def concat_batches(batches: list[StepBatch], pad_id: int) -> StepBatch:
    """Scored batches of several rounds as one, rows in order."""
    if len(batches) == 1:
        return batches[0]
    names = batches[0].scores.per_function
    scores = ScoreResult(
        total=[x for b in batches for x in b.scores.total],
        per_function={name: [x for b in batches for x in b.scores.per_function[name]] for name in names},
    )
    return StepBatch(
        [e for b in batches for e in b.examples],
        concat_rollouts([b.rollout for b in batches], pad_id),
        torch.cat([b.rewards for b in batches]),  # [B, G]
        torch.cat([b.valid for b in batches]),  # [B, G]
        scores,
    )


def completion_rows(ctx: RunContext, examples, batch: StepBatch, step: int) -> list[dict]:
    """One row per completion for the completions table: what was asked, answered and rewarded."""
    g = ctx.cfg.grpo.group_size
    texts = ctx.tokenizer.batch_decode(batch.rollout.completion_ids, skip_special_tokens=True)
    advantages = batch.advantages.tolist()  # [N] one host copy, on table steps only
    nan = float("nan")  # an unscorable completion has no reward; a table column keeps one type
    rows = []
    for i, text in enumerate(texts):
        example = examples[i // g]
        row = {"step": step, "prompt": example.question, "completion": text, "gold": example.answer}
        row |= {name: nan if v[i] is None else v[i] for name, v in batch.scores.per_function.items()}
        total = batch.scores.total[i]
        row |= {"reward": nan if total is None else total, "advantage": advantages[i]}
        rows.append(row)
    return rows


def record_reward_stats(ctx: RunContext, stats: M.StepMetrics, batch: StepBatch) -> None:
    rewards, valid, rollout = batch.rewards, batch.valid, batch.rollout
    v = valid.to(rewards.dtype)
    stats.add_rewards(rewards, v)
    for name, values in batch.scores.per_function.items():
        known = [x for x in values if x is not None]
        stats.add_mean(M.REWARD_FN_MEAN.format(name), sum(known), len(known))
    zero_std = zero_std_groups(rewards, valid=valid)  # [B]
    first = rewards[:, 0]  # [B] the common value of a zero-std group
    stats.add_mean(M.FRAC_REWARD_ZERO_STD, zero_std.sum(), zero_std.numel())
    stats.add_mean(M.FRAC_ALL_CORRECT, (zero_std & (first >= ctx.reward_max)).sum(), zero_std.numel())
    stats.add_mean(M.FRAC_ALL_WRONG, (zero_std & (first <= ctx.reward_min)).sum(), zero_std.numel())
    lengths = rollout.completion_lengths.to(torch.float64)  # [N]
    stats.add_mean(M.COMPLETION_LEN_MEAN, lengths.sum(), lengths.numel())
    stats.add_max(M.COMPLETION_LEN_MAX, lengths.max())
    stats.add_mean(M.TRUNCATED_FRACTION, rollout.truncated.sum(), rollout.truncated.numel())


def rows_to_train(ctx: RunContext, batch: StepBatch) -> StepBatch:
    """The batch the update runs on: the loss denominator fixed over every row first, then (β = 0, no
    entropy bonus) the rows with zero advantage or no loss token left out. Their loss and gradient are
    exactly 0, so the step is the same; early in a run, when most groups have equal rewards, this is
    most of the forward/backward work (README, "Performance")."""
    g = ctx.cfg.grpo
    batch.normalizer = ctx.engine.all_reduce_sum(loss_normalizer(batch.loss_mask, g.aggregation))
    if not (ctx.cfg.trainer.skip_zero_advantage and ctx.beta == 0 and g.entropy_coef == 0):
        return batch
    rows = rows_with_gradient(batch.advantages, batch.loss_mask)
    index = torch.tensor(rows, dtype=torch.long, device=batch.advantages.device)  # [n]
    kept_mask = batch.loss_mask[index]  # [n, T]
    return replace(
        batch,
        rollout=take_rows(batch.rollout, rows),
        advantages=batch.advantages[index],
        loss_mask=kept_mask,
        skipped_loss_tokens=batch.loss_mask.sum() - kept_mask.sum(),
    )


def micro_batches(ctx: RunContext, n: int) -> list[slice]:
    size = ctx.cfg.trainer.micro_batch_size
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


@torch.no_grad()
def old_and_reference_logprobs(
    ctx: RunContext, rollout: Rollout
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """π_old only when μ > 1 (μ = 1 reuses the detached current log-probs); π_ref only when β > 0."""
    cfg = ctx.cfg
    models = {
        "old": ctx.policy if cfg.grpo.num_iterations > 1 else None,
        "ref": ctx.reference if cfg.grpo.beta > 0 else None,
    }
    out: dict[str, torch.Tensor | None] = {}
    for name, model in models.items():
        if model is None:
            out[name] = None
            continue
        full = torch.zeros(rollout.completion_ids.shape, dtype=torch.float32, device=ctx.device)  # [N, T]
        for mb in micro_batches(ctx, rollout.completion_ids.size(0)):
            lp, t = logprobs_for(ctx, model, rollout, mb, with_entropy=False)[0], None
            t = lp.size(1)
            full[mb, :t] = lp
        out[name] = full
    return out["old"], out["ref"]


def logprobs_for(
    ctx: RunContext,
    model,
    rollout: Rollout,
    mb: slice,
    *,
    with_entropy: bool,
    entropy_grad: bool = False,
    casts: WeightCasts | None = None,
):
    """Log-probs (and entropy, with gradient for an entropy bonus) of the micro-batch's completions,
    padding columns trimmed; `casts`: the update's weights cast once (`models/weight_casts.py`)."""
    p_ids, p_mask, c_ids, _ = trim_columns(
        rollout.prompt_ids[mb],
        rollout.prompt_mask[mb],
        rollout.completion_ids[mb],
        rollout.completion_mask[mb],
    )
    t = ctx.cfg.trainer
    with ctx.autocast():
        return completion_logprobs(
            model,
            p_ids,
            p_mask,
            c_ids,
            temperature=ctx.cfg.generation.temperature,
            chunk_size=t.logprob_chunk_size,
            with_entropy=with_entropy,
            entropy_grad=entropy_grad,
            backend=t.forward_backend,
            share_prompts=t.shared_prompt_forward,
            weight_casts=casts,
            fused_head=t.fused_lm_head,
            trim_every_layers=t.release_free_memory_layers if t.release_free_memory else 0,
        )


def update(ctx: RunContext, batch: StepBatch, stats: M.StepMetrics) -> None:
    """One optimizer step over the whole step's completions, accumulated over micro-batches."""
    g = ctx.cfg.grpo
    rollout = batch.rollout
    mask_full = batch.loss_mask  # [N, T]
    normalizer = batch.normalizer
    step_loss = torch.zeros((), dtype=torch.float64, device=ctx.device)
    casts = weight_casts(ctx)  # the weights stay fixed until this update's optimizer step
    chunks = micro_batches(ctx, mask_full.size(0))
    for mb in chunks:
        if casts is not None and mb is chunks[-1]:
            casts.release_on_use()  # no later forward needs them: each freed with the graph that uses it
        logprobs, entropy = logprobs_for(
            ctx,
            ctx.engine.module,
            rollout,
            mb,
            with_entropy=True,
            entropy_grad=g.entropy_coef > 0,
            casts=casts,
        )
        t = logprobs.size(1)
        mask = mask_full[mb, :t]  # [n, T']
        old = logprobs.detach() if batch.old_logprobs is None else batch.old_logprobs[mb, :t]
        ref = None if batch.ref_logprobs is None else batch.ref_logprobs[mb, :t]
        out = policy_loss(
            logprobs,
            old,
            ref,
            batch.advantages[mb],
            mask,
            epsilon=g.epsilon,
            epsilon_high=g.epsilon if g.epsilon_high is None else g.epsilon_high,
            beta=ctx.beta,
            aggregation=g.aggregation,
            normalizer=normalizer,
            constant_length=g.constant_length,
            clip_ratio_c=g.clip_ratio_c,
            kl_estimator=g.kl_estimator,
            importance_level=g.importance_level,
            entropy=entropy if g.entropy_coef > 0 else None,
            entropy_coef=g.entropy_coef,
        )
        ctx.engine.backward(nonfinite_to_grad(out.loss))
        step_loss = step_loss + out.loss.detach()
        tokens = mask.sum()
        if g.beta > 0:
            stats.add_mean(M.KL, out.kl * tokens, tokens)
        stats.add_mean(M.CLIP_FRACTION, out.clip_fraction * tokens, tokens)
        stats.add_mean(M.CLIP_FRACTION_LOW, out.clip_fraction_low * tokens, tokens)
        stats.add_mean(M.CLIP_FRACTION_HIGH, out.clip_fraction_high * tokens, tokens)
        # Entropy: every sampled token of the rows in the update, in the loss or masked out of it.
        sampled = rollout.completion_mask[mb, :t].float()  # [n, T']
        stats.add_mean(M.ENTROPY, masked_mean(entropy.detach(), sampled) * sampled.sum(), sampled.sum())
    # Rows left out of the update are never clipped (A = 0): they only count in the denominators.
    for key in (M.CLIP_FRACTION, M.CLIP_FRACTION_LOW, M.CLIP_FRACTION_HIGH):
        stats.add_mean(key, 0.0, batch.skipped_loss_tokens)
    del casts  # stale after the step, and 0.27 GB on SmolLM2
    grad_norm = ctx.engine.step()  # skips the update when the norm is not finite
    ctx.sampling.mark_stale()
    skipped = not bool(torch.isfinite(grad_norm))  # the one host check of this optimizer step
    ctx.nonfinite_streak = ctx.nonfinite_streak + 1 if skipped else 0
    stats.add_sum(M.SKIPPED_STEPS, float(skipped))
    # Means over the μ iterations; the loss is summed over micro-batches (and ranks) first.
    stats.add_mean(M.LOSS, step_loss, 1.0 / ctx.engine.world_size)
    # The norm is already the whole step's on every rank: each rank contributes 1/world of it.
    stats.add_mean(M.GRAD_NORM, grad_norm / ctx.engine.world_size, 1.0 / ctx.engine.world_size)


def weight_casts(ctx: RunContext) -> WeightCasts | None:
    """A fresh cache of the policy's bf16 weight casts for one optimizer step, where they apply (where a
    bf16 copy of the weights helps at all: float32 weights under bf16 autocast)."""
    wanted = wants_bf16_copy(
        autocast_bf16=ctx.cfg.model.autocast_bf16,
        weight_dtype=next(ctx.engine.module.parameters()).dtype,
        enabled=ctx.cfg.trainer.cast_weights_once,
    )
    return WeightCasts() if wanted else None


def loss_normalizer(loss_mask: torch.Tensor, aggregation: Aggregation) -> torch.Tensor:
    """This process's share of the step-level denominator, so summed micro-batch losses equal the step's.

    per_token: loss tokens; per_response and constant_length: completions still in the loss
    (mask_truncated removes some; without it every completion has at least one token). loss_mask [N, T].
    """
    if aggregation == Aggregation.PER_TOKEN:
        return loss_mask.sum()  # []
    return (loss_mask.sum(-1) > 0).sum().to(loss_mask.dtype)  # []


def nonfinite_to_grad(loss: torch.Tensor) -> torch.Tensor:
    """`loss`, made to give NaN gradients when its value is not finite (no host sync).

    A NaN added to a term without parameters leaves the gradient finite; scaling by NaN makes every
    gradient NaN, so the engine's non-finite grad-norm check skips the update whatever the cause.
    A finite loss is multiplied by exactly 1.0: its gradients are unchanged bit for bit.
    """
    return loss * torch.where(torch.isfinite(loss.detach()), 1.0, float("nan"))  # []
