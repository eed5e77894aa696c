"""The last stages of a step: scored groups → a training batch → one optimizer step per GRPO iteration.

Row b·G + g of the batch is completion g of group b, until `rows_to_train` leaves out rows that cannot
move the weights.
"""

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from grpo_run import metrics as M
from grpo_run.algo import (
    Aggregation,
    RolloutCorrection,
    compute_advantages,
    masked_mean,
    mismatch_stats,
    policy_loss,
    rollout_correction_weights,
)
from grpo_run.config.schema import GrpoConfig, TrainerConfig
from grpo_run.engine.base import Engine
from grpo_run.models.forward import TrainingForward, trim_columns
from grpo_run.rollout.engines import GenerationEngine
from grpo_run.rollout.filtering import loss_mask, rows_with_gradient, take_rows
from grpo_run.rollout.generate import Rollout
from grpo_run.rollout.groups import ScoredGroups


@dataclass
class TrainingBatch:
    """What the policy update needs; every field is set when the batch is built."""

    rollout: Rollout
    advantages: torch.Tensor  # [N]
    loss_mask: torch.Tensor  # [N, T] float: completion mask, minus what mask_truncated drops
    normalizer: torch.Tensor  # [] the loss denominator of the whole step, every rank
    old_logprobs: torch.Tensor | None  # [N, T], None when μ = 1 (the detached current ones are used)
    ref_logprobs: torch.Tensor | None  # [N, T], None when β = 0
    skipped_loss_tokens: torch.Tensor | float = 0.0  # [] loss tokens of rows left out of the update


def advantages_and_mask(
    grpo: GrpoConfig, groups: ScoredGroups, stats: M.StepMetrics
) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-relative advantages [N] and the loss mask [N, T] of the step's groups."""
    g = grpo
    advantages = compute_advantages(
        groups.rewards, g.advantage_mode, g.std_correction, g.advantage_eps, valid=groups.valid
    ).reshape(-1)  # [N]; normalized_batch: σ over every reward of the step's update (this process's)
    mask = loss_mask(groups.rollout, g.mask_truncated)  # [N, T]
    stats.add_sum(M.MASKED_TRUNCATED, groups.rollout.truncated.sum() if g.mask_truncated else 0)
    return advantages, mask


def anything_to_learn(engine: Engine, mask: torch.Tensor, *, mask_truncated: bool) -> bool:
    """Every completion truncated and masked leaves nothing to learn from, and an optimizer step on a zero
    gradient would still move the weights by Adam's momentum. One sync, agreed by every rank."""
    return not mask_truncated or bool(engine.all_reduce_sum(mask.sum()).item())


def training_batch(
    rollout: Rollout,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    grpo: GrpoConfig,
    trainer: TrainerConfig,
    beta: float,
    engine: Engine,
    forward: TrainingForward,
    policy: torch.nn.Module,
    reference: Callable[[], contextlib.AbstractContextManager] | None,
) -> TrainingBatch:
    """The loss denominator fixed over every row first, then the rows to train on, then π_old and π_ref.

    beta: this step's KL coefficient (rows without advantage still carry its gradient); reference: a
    context giving π_ref's model (None when grpo.beta = 0)."""
    normalizer = engine.all_reduce_sum(loss_normalizer(mask, grpo.aggregation))
    skip = trainer.skip_zero_advantage and beta == 0 and grpo.entropy_coef == 0
    rollout, advantages, kept_mask, skipped = rows_to_train(rollout, advantages, mask, skip=skip)
    old, ref = old_and_reference_logprobs(
        rollout,
        forward=forward,
        old=policy if grpo.num_iterations > 1 else None,
        reference=reference if grpo.beta > 0 else None,
        micro_batch_size=trainer.micro_batch_size,
    )
    return TrainingBatch(rollout, advantages, kept_mask, normalizer, old, ref, skipped)


def rows_to_train(rollout: Rollout, advantages: torch.Tensor, mask: torch.Tensor, *, skip: bool):
    """(rollout, advantages, loss mask, skipped loss tokens) of the rows the update runs on: with `skip`
    (trainer.skip_zero_advantage with β = 0 and no entropy bonus) the rows with zero advantage or no loss
    token are left out. Their loss and gradient are exactly 0, so the step is the same; early in a run,
    when most groups have equal rewards, this is most of the forward/backward work."""
    if not skip:
        return rollout, advantages, mask, 0.0
    rows = rows_with_gradient(advantages, mask)
    index = torch.tensor(rows, dtype=torch.long, device=advantages.device)  # [n]
    kept = mask[index]  # [n, T]
    return take_rows(rollout, rows), advantages[index], kept, mask.sum() - kept.sum()


def micro_batches(n: int, size: int) -> list[slice]:
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


def logprobs_for(
    forward: TrainingForward,
    model,
    rollout: Rollout,
    mb: slice,
    *,
    with_entropy: bool,
    entropy_grad: bool = False,
):
    """(log-probs, entropy or None) [n, T'] of the micro-batch's completions, padding columns trimmed."""
    p_ids, p_mask, c_ids, _ = trim_columns(
        rollout.prompt_ids[mb],
        rollout.prompt_mask[mb],
        rollout.completion_ids[mb],
        rollout.completion_mask[mb],
    )
    return forward.logprobs(model, p_ids, p_mask, c_ids, with_entropy=with_entropy, entropy_grad=entropy_grad)


@torch.no_grad()
def old_and_reference_logprobs(
    rollout: Rollout,
    *,
    forward: TrainingForward,
    old: torch.nn.Module | None,
    reference: Callable[[], contextlib.AbstractContextManager] | None,
    micro_batch_size: int,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """π_old from `old` (the policy; None when μ = 1, which reuses the detached current log-probs) and π_ref
    from the model `reference()` gives (None when β = 0; with LoRA the policy with its adapter disabled)."""
    models = {
        "old": contextlib.nullcontext(old) if old is not None else None,
        "ref": reference() if reference is not None else None,
    }
    out: dict[str, torch.Tensor | None] = {}
    device = rollout.completion_ids.device
    for name, model_in in models.items():
        if model_in is None:
            out[name] = None
            continue
        full = torch.zeros(rollout.completion_ids.shape, dtype=torch.float32, device=device)  # [N, T]
        with model_in as model:
            for mb in micro_batches(rollout.completion_ids.size(0), micro_batch_size):
                lp = logprobs_for(forward, model, rollout, mb, with_entropy=False)[0]  # [n, T']
                full[mb, : lp.size(1)] = lp
        out[name] = full
    return out["old"], out["ref"]


def policy_update(
    batch: TrainingBatch,
    stats: M.StepMetrics,
    *,
    grpo: GrpoConfig,
    beta: float,
    micro_batch_size: int,
    engine: Engine,
    forward: TrainingForward,
    generation: GenerationEngine,
) -> bool:
    """One optimizer step over the whole step's completions, accumulated over micro-batches; True when
    the engine skipped it for a non-finite loss or gradient. beta: this step's KL coefficient."""
    g = grpo
    rollout, mask_full = batch.rollout, batch.loss_mask  # [N, T]
    step_loss = torch.zeros((), dtype=torch.float64, device=mask_full.device)
    chunks = micro_batches(mask_full.size(0), micro_batch_size)
    model = engine.module
    with forward.optimizer_step(model, len(chunks)):  # the weights stay fixed until engine.step()
        for mb in chunks:
            logprobs, entropy = logprobs_for(
                forward, model, rollout, mb, with_entropy=True, entropy_grad=g.entropy_coef > 0
            )
            t = logprobs.size(1)
            mask = mask_full[mb, :t]  # [n, T']
            old = logprobs.detach() if batch.old_logprobs is None else batch.old_logprobs[mb, :t]
            ref = None if batch.ref_logprobs is None else batch.ref_logprobs[mb, :t]
            weights = sampler_correction(rollout, mb, old, mask, stats, grpo=g)
            out = policy_loss(
                logprobs,
                old,
                ref,
                batch.advantages[mb],
                mask,
                epsilon=g.epsilon,
                epsilon_high=g.epsilon if g.epsilon_high is None else g.epsilon_high,
                beta=beta,
                aggregation=g.aggregation,
                normalizer=batch.normalizer,
                constant_length=g.constant_length,
                clip_ratio_c=g.clip_ratio_c,
                kl_estimator=g.kl_estimator,
                importance_level=g.importance_level,
                entropy=entropy if g.entropy_coef > 0 else None,
                entropy_coef=g.entropy_coef,
                token_weights=weights,
            )
            engine.backward(nonfinite_to_grad(out.loss))
            step_loss = step_loss + out.loss.detach()
            record_loss_stats(stats, out, mask, entropy, rollout.completion_mask[mb, :t], g.beta > 0)
    # Rows left out of the update are never clipped (A = 0): they only count in the denominators.
    for key in (M.CLIP_FRACTION, M.CLIP_FRACTION_LOW, M.CLIP_FRACTION_HIGH):
        stats.add_mean(key, 0.0, batch.skipped_loss_tokens)
    grad_norm = engine.step()  # skips the update when the norm is not finite
    generation.policy_updated()
    skipped = not bool(torch.isfinite(grad_norm))  # the one host check of this optimizer step
    stats.add_sum(M.SKIPPED_STEPS, float(skipped))
    # Means over the μ iterations; the loss is summed over micro-batches (and ranks) first.
    stats.add_mean(M.LOSS, step_loss, 1.0 / engine.world_size)
    # The norm is already the whole step's on every rank: each rank contributes 1/world of it.
    stats.add_mean(M.GRAD_NORM, grad_norm / engine.world_size, 1.0 / engine.world_size)
    return skipped


def sampler_correction(
    rollout: Rollout,
    mb: slice,
    old: torch.Tensor,
    mask: torch.Tensor,
    stats: M.StepMetrics,
    *,
    grpo: GrpoConfig,
) -> torch.Tensor | None:
    """A separate sampler (vLLM): log its mismatch with pi_old and return grpo.rollout_correction's
    per-token weights [n, T'] of the surrogate (None: the trainer's own forward sampled, or mode none)."""
    if rollout.sampler_logprobs is None:
        return None
    g = grpo
    sampler = rollout.sampler_logprobs[mb, : old.size(1)]  # [n, T']
    corr = rollout_correction_weights(
        old, sampler, mask, mode=g.rollout_correction, cap=g.rollout_correction_cap
    )
    s = mismatch_stats(old, sampler, mask, corr)
    stats.add_mean(M.SAMPLER_LOGPROB_DIFF_MEAN, s.abs_diff_sum, s.tokens)
    stats.add_max(M.SAMPLER_LOGPROB_DIFF_MAX, s.abs_diff_max)
    stats.add_mean(M.SAMPLER_RATIO_MEAN, s.ratio_sum, s.tokens)
    stats.add_max(M.SAMPLER_RATIO_MAX, s.ratio_max)
    stats.add_mean(M.SAMPLER_MASKED_FRACTION, s.rejected, s.tokens)
    return None if g.rollout_correction == RolloutCorrection.NONE else corr.weights


def record_loss_stats(stats: M.StepMetrics, out, mask, entropy, sampled_mask, with_kl: bool) -> None:
    """KL, clip fractions (over loss tokens) and entropy (over every sampled token) of one micro-batch."""
    tokens = mask.sum()
    if with_kl:
        stats.add_mean(M.KL, out.kl * tokens, tokens)
    stats.add_mean(M.CLIP_FRACTION, out.clip_fraction * tokens, tokens)
    stats.add_mean(M.CLIP_FRACTION_LOW, out.clip_fraction_low * tokens, tokens)
    stats.add_mean(M.CLIP_FRACTION_HIGH, out.clip_fraction_high * tokens, tokens)
    # Entropy: every sampled token of the rows in the update, in the loss or masked out of it.
    sampled = sampled_mask.float()  # [n, T']
    stats.add_mean(M.ENTROPY, masked_mean(entropy.detach(), sampled) * sampled.sum(), sampled.sum())


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
