"""The GRPO loop, read top to bottom.

One step: sample B prompts → G completions each → rewards [B, G] → group-relative advantages →
old and reference log-probs → μ passes of micro-batched policy-gradient updates → metrics.
"""

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from grpo_run import metrics as M
from grpo_run.algo import Aggregation, compute_advantages, masked_mean, policy_loss, zero_std_groups
from grpo_run.config.schema import Config
from grpo_run.models.forward import completion_logprobs, trim_columns
from grpo_run.rewards.scoring import ScoreResult
from grpo_run.rollout.generate import Rollout, SamplingParams, generate_group_completions, group_seed
from grpo_run.run_context import RunContext, build_context, peak_memory_gb


@dataclass
class StepBatch:
    """Everything the update needs about one step's B·G completions (row b·G + g)."""

    rollout: Rollout
    rewards: torch.Tensor  # [B, G]
    valid: torch.Tensor  # [B, G] bool: scorable
    advantages: torch.Tensor  # [N]
    old_logprobs: torch.Tensor | None  # [N, T], None when μ = 1 (the detached current ones are used)
    ref_logprobs: torch.Tensor | None  # [N, T], None when β = 0
    scores: ScoreResult


def train(cfg: Config) -> dict[str, float]:
    """Run GRPO for `trainer.max_steps` steps; return the last step's metrics."""
    ctx = build_context(cfg)
    last: dict[str, float] = {}
    try:
        for step in range(ctx.start_step + 1, cfg.trainer.max_steps + 1):
            last = train_step(ctx, step)
            ctx.tracker.log(step, last)
        save_final(ctx)
    finally:
        ctx.close()
    return last


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

    examples = ctx.sampler.next_batch()
    rollout = generate(ctx, [e.question for e in examples], step)
    t_gen = time.perf_counter()

    batch = score_and_compare(ctx, examples, rollout, stats)
    batch.old_logprobs, batch.ref_logprobs = old_and_reference_logprobs(ctx, rollout)
    t_ref = time.perf_counter()

    for _ in range(cfg.grpo.num_iterations):
        update(ctx, batch, stats)
    t_end = time.perf_counter()

    tokens = rollout.completion_mask.sum() + rollout.prompt_mask.sum()
    stats.set_host(M.LR, ctx.engine.current_lr())
    stats.set_host(M.BETA, cfg.grpo.beta)
    stats.set_host(M.STEP_S, t_end - t0)
    stats.set_host(M.GENERATE_S, t_gen - t0)
    stats.set_host(M.REFERENCE_S, t_ref - t_gen)
    stats.set_host(M.TRAIN_S, t_end - t_ref)
    stats.add_sum(M.TOKENS_PER_S, tokens / (t_end - t0))
    stats.set_host(M.PEAK_MEM_GB, peak_memory_gb(ctx.device))
    return stats.reduce(ctx.engine)


def generate(ctx: RunContext, questions: list[str], step: int) -> Rollout:
    """G completions for each prompt; each group's noise is seeded by (seed, step, prompt index)."""
    cfg = ctx.cfg
    enc = ctx.tokenizer(
        ctx.format_prompts(questions), return_tensors="pt", padding=True, add_special_tokens=False
    )
    first_index = (step - 1) * cfg.trainer.prompts_per_step
    seeds = [group_seed(cfg.trainer.seed, step, first_index + i) for i in range(len(questions))]
    params = SamplingParams(
        max_new_tokens=cfg.generation.max_new_tokens,
        temperature=cfg.generation.temperature,
        top_p=cfg.generation.top_p,
        top_k=cfg.generation.top_k,
    )
    ctx.policy.eval()
    with ctx.autocast():
        rollout = generate_group_completions(
            ctx.policy,
            enc.input_ids.to(ctx.device),
            enc.attention_mask.to(ctx.device),
            group_size=cfg.grpo.group_size,
            params=params,
            eos_id=ctx.tokenizer.eos_token_id,
            pad_id=ctx.tokenizer.pad_token_id,
            seeds=seeds,
        )
    ctx.policy.train()
    return rollout


def score_and_compare(ctx: RunContext, examples, rollout: Rollout, stats: M.StepMetrics) -> StepBatch:
    """Rewards [B, G] for the decoded completions, then the group-relative advantages."""
    cfg, g = ctx.cfg, ctx.cfg.grpo.group_size
    completions = ctx.tokenizer.batch_decode(rollout.completion_ids, skip_special_tokens=True)
    prompts = [e.question for e in examples for _ in range(g)]
    answers = [e.answer for e in examples for _ in range(g)]
    scores = ctx.score(prompts, completions, answers, rollout.completion_lengths.tolist())
    ctx.report_reward_errors(scores)

    valid = torch.tensor([r is not None for r in scores.total], device=ctx.device).view(-1, g)  # [B, G]
    rewards = torch.tensor([0.0 if r is None else r for r in scores.total], device=ctx.device).view(-1, g)
    advantages = compute_advantages(
        rewards, cfg.grpo.advantage_mode, cfg.grpo.std_correction, cfg.grpo.advantage_eps, valid=valid
    )  # [B, G]
    record_reward_stats(ctx, stats, rewards, valid, scores, rollout)
    return StepBatch(rollout, rewards, valid, advantages.reshape(-1), None, None, scores)


def record_reward_stats(ctx: RunContext, stats: M.StepMetrics, rewards, valid, scores, rollout) -> None:
    v = valid.to(rewards.dtype)
    stats.add_rewards(rewards, v)
    for name, values in scores.per_function.items():
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
    stats.add_sum(M.REWARD_ERRORS, scores.errors)
    stats.add_sum(M.REWARD_TIMEOUTS, scores.timeouts)
    stats.add_sum(M.REWARD_UNSCORABLE, scores.unscorable)


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


def logprobs_for(ctx: RunContext, model, rollout: Rollout, mb: slice, *, with_entropy: bool):
    """Log-probs (and entropy) of the micro-batch's completions, padding columns trimmed."""
    p_ids, p_mask, c_ids, _ = trim_columns(
        rollout.prompt_ids[mb],
        rollout.prompt_mask[mb],
        rollout.completion_ids[mb],
        rollout.completion_mask[mb],
    )
    with ctx.autocast():
        return completion_logprobs(
            model,
            p_ids,
            p_mask,
            c_ids,
            temperature=ctx.cfg.generation.temperature,
            chunk_size=ctx.cfg.trainer.logprob_chunk_size,
            with_entropy=with_entropy,
        )


def update(ctx: RunContext, batch: StepBatch, stats: M.StepMetrics) -> None:
    """One optimizer step over the whole step's completions, accumulated over micro-batches."""
    g = ctx.cfg.grpo
    rollout = batch.rollout
    mask_full = rollout.completion_mask.float()  # [N, T]
    # Step-level denominators, so the summed micro-batch losses equal the whole step's loss.
    if g.aggregation == Aggregation.PER_TOKEN:
        normalizer = ctx.engine.all_reduce_sum(mask_full.sum())
    else:
        normalizer = ctx.engine.all_reduce_sum(torch.tensor(float(mask_full.size(0)), device=ctx.device))
    step_loss = torch.zeros((), dtype=torch.float64, device=ctx.device)
    for mb in micro_batches(ctx, mask_full.size(0)):
        logprobs, entropy = logprobs_for(ctx, ctx.engine.module, rollout, mb, with_entropy=True)
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
            beta=g.beta,
            aggregation=g.aggregation,
            normalizer=normalizer,
        )
        ctx.engine.backward(out.loss)
        step_loss = step_loss + out.loss.detach()
        tokens = mask.sum()
        if g.beta > 0:
            stats.add_mean(M.KL, out.kl * tokens, tokens)
        stats.add_mean(M.CLIP_FRACTION, out.clip_fraction * tokens, tokens)
        stats.add_mean(M.CLIP_FRACTION_LOW, out.clip_fraction_low * tokens, tokens)
        stats.add_mean(M.CLIP_FRACTION_HIGH, out.clip_fraction_high * tokens, tokens)
        stats.add_mean(M.ENTROPY, masked_mean(entropy, mask) * tokens, tokens)
    grad_norm = ctx.engine.step()
    # Means over the μ iterations; the loss is summed over micro-batches (and ranks) first.
    stats.add_mean(M.LOSS, step_loss, 1.0 / ctx.engine.world_size)
    stats.add_mean(M.GRAD_NORM, grad_norm, 1.0 / ctx.engine.world_size)
