"""The last stages of a step: scored groups → a training batch → one optimizer step per GRPO iteration.

Row b·G + g of the batch is completion g of group b, until `rows_to_train` leaves out rows that cannot
move the weights.
"""

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from grpo_run import metrics as M
from grpo_run.algo import (
    DISTILL_FORMS,
    POLICY_LOSSES,
    Aggregation,
    EntropyControl,
    HeadStates,
    LossInputs,
    LossSettings,
    OffPolicyLoss,
    RewardAggregation,
    RolloutCorrection,
    aggregate,
    applied_entropy_coef,
    compute_advantages,
    form_knobs,
    masked_mean,
    mismatch_stats,
    normalize_then_sum,
    policy_loss,
    rollout_correction_weights,
    teacher_gap,
)
from grpo_run.config.schema import Config, DistillConfig, GrpoConfig, RewardConfig
from grpo_run.data import Example
from grpo_run.engine.base import Engine
from grpo_run.micro_batches import MicroBatch, micro_batches_for
from grpo_run.models.forward import TrainingForward, trim_columns
from grpo_run.passes import Between, logprobs_for, old_and_reference_logprobs
from grpo_run.rollout.filtering import loss_mask, rows_with_gradient, take_rows
from grpo_run.rollout.generate import Rollout
from grpo_run.rollout.groups import ScoredGroups
from grpo_run.safety import update_norm
from grpo_run.teacher import Teacher, score


@dataclass
class TrainingBatch:
    """What the policy update needs; every field is set when the batch is built."""

    rollout: Rollout
    advantages: torch.Tensor  # [N], or [N, T] per token (distill.form=advantage: `distilled_batch`)
    loss_mask: torch.Tensor  # [N, T] float: completion mask, minus what mask_truncated drops
    normalizer: torch.Tensor  # [] the loss denominator of the whole step, every rank
    old_logprobs: torch.Tensor | None  # [N, T], None when μ = 1 (the detached current ones are used)
    ref_logprobs: torch.Tensor | None  # [N, T], None when β = 0
    skipped_loss_tokens: torch.Tensor | float = 0.0  # [] loss tokens of rows left out of the update
    # [N, T, H] distill.form=distribution: the teacher's LM-head input at each completion position and its
    # head (its full next-token distributions, `DistillFormSpec.teacher_states`); else None
    teacher_states: HeadStates | None = None
    # [N, T] distill != none: log π_old without gradient, the student's side of the teacher term (also
    # at μ = 1, where old_logprobs stays None and the update keeps its detached current log-probs)
    student_logprobs: torch.Tensor | None = None


@dataclass(frozen=True)
class StepInputs:
    """What the step trains on: its completions, their group-relative advantages and loss mask
    (`advantages_and_mask`), and the groups' prompts, which a self-teacher reads (row b·G + g: examples[b])."""

    rollout: Rollout
    advantages: torch.Tensor  # [N]
    mask: torch.Tensor  # [N, T]
    examples: list[Example] = field(default_factory=list)


@dataclass(frozen=True)
class UpdateSettings:
    """What stays fixed for the run: the update's hyper-parameters, read from the typed config once."""

    grpo: GrpoConfig
    loss: LossSettings  # the policy loss's (`loss_settings`)
    distill: DistillConfig
    micro_batch_size: int  # trainer.micro_batch_size
    skip_zero_advantage: bool  # trainer.skip_zero_advantage

    @classmethod
    def of(cls, cfg: Config, loss: LossSettings | None = None) -> "UpdateSettings":
        t = cfg.trainer
        loss = loss_settings(cfg) if loss is None else loss
        return cls(cfg.grpo, loss, cfg.distill, t.micro_batch_size, t.skip_zero_advantage)


@dataclass(frozen=True)
class UpdateModels:
    """The models a step's update reads, and the loop's stop point."""

    engine: Engine  # the trained policy (engine.module), its optimizer and collectives
    forward: TrainingForward
    policy: torch.nn.Module  # π_old's model: the policy as it was when the step sampled
    reference: Callable[[], contextlib.AbstractContextManager] | None = None  # π_ref's (None: β = 0)
    teacher: Teacher | None = None  # distill != none
    # The loop's stop point, called before each micro-batch of every pass (`safety.stop.stop_point` on the
    # engine's flag: all ranks stop together); None never stops (a test, or a pass without collectives).
    stop: Between | None = None


@dataclass(frozen=True)
class StepCoefs:
    """This step's coefficients, which controllers move between steps."""

    beta: float  # the KL term's (kl_control)
    entropy_coef: float  # the entropy bonus's (`step_entropy_coef`)


def advantages_and_mask(
    grpo: GrpoConfig, groups: ScoredGroups, stats: M.StepMetrics, *, reward: RewardConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-relative advantages [N] and the loss mask [N, T] of the step's groups (reward: read for
    reward.aggregation=normalize_then_sum, which normalizes each function's reward before the sum)."""
    g = grpo
    if reward.aggregation == RewardAggregation.NORMALIZE_THEN_SUM:
        advantages = gdpo_advantages(g, reward, groups)  # [N]
    else:
        advantages = compute_advantages(
            groups.rewards, g.advantage_mode, g.std_correction, g.advantage_eps, valid=groups.valid
        ).reshape(-1)  # [N]; normalized_batch: σ over every reward of the step's update (this process's)
    mask = loss_mask(groups.rollout, g.mask_truncated)  # [N, T]
    stats.add_sum(M.MASKED_TRUNCATED, groups.rollout.truncated.sum() if g.mask_truncated else 0)
    record_trained(stats, mask)
    return advantages, mask


def record_trained(stats: M.StepMetrics, mask: torch.Tensor) -> None:
    """The step's rows that reach the update: trained when a token of theirs is in the loss, else dropped
    as masked. A trained row enters every optimizer step of the step (with skip_zero_advantage a row with
    A = 0 is left out of the forward pass because its loss and gradient are exactly 0: still trained)."""
    in_loss = mask.sum(-1) > 0  # [N]
    stats.add_sum(M.TRAINED_COMPLETIONS, in_loss.sum())
    stats.add_sum(M.DROPPED_MASKED, (~in_loss).sum())


def gdpo_advantages(grpo: GrpoConfig, reward: RewardConfig, groups: ScoredGroups) -> torch.Tensor:
    """reward.aggregation=normalize_then_sum: GDPO over the per-function rewards of the step's groups. [N]"""
    fns = reward.functions
    per_fn = groups.scores.per_function
    values = [[0.0 if v is None else v for v in per_fn[f.name]] for f in fns]  # K lists of [N]
    rewards = torch.tensor(values, dtype=torch.float32, device=groups.rewards.device).T  # [N, K]
    rewards = rewards.view(*groups.rewards.shape, len(fns))  # [B, G, K]
    weights = torch.tensor([f.weight for f in fns], dtype=torch.float32, device=rewards.device)  # [K]
    return normalize_then_sum(
        rewards, weights, grpo.std_correction, grpo.advantage_eps, groups.valid
    ).reshape(-1)


def anything_to_learn(engine: Engine, mask: torch.Tensor, *, mask_truncated: bool) -> bool:
    """Every completion truncated and masked leaves nothing to learn from, and an optimizer step on a zero
    gradient would still move the weights by Adam's momentum. One sync, agreed by every rank."""
    return not mask_truncated or bool(engine.all_reduce_sum(mask.sum()).item())


def training_batch(
    step: StepInputs, stats: M.StepMetrics, run: UpdateSettings, models: UpdateModels, coefs: StepCoefs
) -> TrainingBatch:
    """The batch the update runs on: the loss denominator fixed over every row first, then the rows to train
    on, then π_old and π_ref, then, when distilling, the teacher's scores (`distilled_batch`).

    coefs: rows without advantage still carry a KL or entropy-bonus gradient; a teacher keeps every row (its term) and needs π_old at μ = 1 too, as
    the student's side of it. Each no-gradient pass calls the loop's stop point before its micro-batches."""
    g, engine = run.grpo, models.engine
    distilling = models.teacher is not None
    normalizer = engine.all_reduce_sum(loss_normalizer(step.mask, g.aggregation))
    skip = not distilling and skips_zero_advantage_rows(run, coefs)
    rollout, advantages, kept_mask, skipped = rows_to_train(
        step.rollout, step.advantages, step.mask, skip=skip, engine=engine
    )
    old, ref = old_and_reference_logprobs(
        rollout,
        forward=models.forward,
        old=models.policy if g.num_iterations > 1 or distilling else None,
        reference=models.reference if g.beta > 0 else None,
        micro_batch_size=run.micro_batch_size,
        between=models.stop,
    )
    batch = TrainingBatch(
        rollout,
        advantages,
        kept_mask,
        normalizer,
        old if g.num_iterations > 1 else None,  # at μ = 1 the update's own detached log-probs are π_old
        ref,
        skipped,
        student_logprobs=old if distilling else None,
    )
    if models.teacher is None:
        return batch
    return distilled_batch(
        batch, step.examples, stats, teacher=models.teacher, distill=run.distill, between=models.stop
    )


def distilled_batch(
    batch: TrainingBatch,
    examples: list[Example],
    stats: M.StepMetrics,
    *,
    teacher: Teacher,
    distill: DistillConfig,
    between: Between | None = None,
) -> TrainingBatch:
    """distill != none: the teacher's scores of the batch's completions (its rows, every one of them:
    `training_batch(distilling=True)`), distill/teacher_kl, distill/teacher_logratio and
    distill/teacher_s, and the batch the update runs, as distill.form's entry of `DISTILL_FORMS` says:
    the advantages the policy loss reads, and the teacher's head states where the form's loss term
    needs full distributions. examples: the groups' prompts [B].

    The student side is `batch.student_logprobs` (π_old without gradient, `training_batch(distilling=True)`),
    the same pass the teacher's log-probs come from: a teacher equal to the student gives exactly 0.
    between: the trainer's stop point, before each micro-batch of the teacher's pass."""
    student = batch.student_logprobs  # [N, T]
    if student is None:
        raise ValueError("distilled_batch needs the student's log-probs: training_batch(distilling=True)")
    form = DISTILL_FORMS[distill.form]
    t0 = time.perf_counter()
    scores = score(teacher, batch.rollout, examples, between, states=form.teacher_states)
    stats.set_host(M.DISTILL_TEACHER_S, time.perf_counter() - t0)
    mask = batch.loss_mask  # [N, T]
    gap = teacher_gap(student, scores.logprobs, mask)
    stats.add_mean(M.DISTILL_TEACHER_KL, gap.kl, gap.tokens)
    stats.add_mean(M.DISTILL_TEACHER_LOGRATIO, gap.logratio, gap.tokens)
    knobs = {k: getattr(distill, k) for k in form_knobs(distill.form)}
    advantages = form.advantages(batch.advantages, student, scores.logprobs, mask, **knobs)  # [N] or [N, T]
    return replace(batch, advantages=advantages, teacher_states=scores.states)


def skips_zero_advantage_rows(run: UpdateSettings, coefs: StepCoefs) -> bool:
    """trainer.skip_zero_advantage applies: without a KL term, an entropy bonus or an entropy quantile a
    row with A = 0 has no gradient. (The quantile is taken over every loss token of a micro-batch, and
    an adaptive bonus may switch on: rows with A = 0 then still change the step.)"""
    g = run.grpo
    fixed = g.top_entropy_quantile == 1.0 and g.entropy_control == EntropyControl.FIXED
    return run.skip_zero_advantage and coefs.beta == 0 and coefs.entropy_coef == 0 and fixed


def rows_to_train(
    rollout: Rollout,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    skip: bool,
    engine: Engine | None = None,
):
    """(rollout, advantages, loss mask, skipped loss tokens) of the rows the update runs on: with `skip`
    (trainer.skip_zero_advantage with β = 0, no entropy bonus and no entropy quantile) the rows with zero advantage or no loss
    token are left out. Their loss and gradient are exactly 0, so the step is the same; early in a run,
    when most groups have equal rewards, this is most of the forward/backward work."""
    if not skip:
        return rollout, advantages, mask, 0.0
    rows = rows_with_gradient(advantages, mask)
    if engine is not None and engine.world_size > 1:
        rows = same_count_on_every_rank(rows, advantages.size(0), engine)
    index = torch.tensor(rows, dtype=torch.long, device=advantages.device)  # [n]
    kept = mask[index]  # [n, T]
    return take_rows(rollout, rows), advantages[index], kept, mask.sum() - kept.sum()


def same_count_on_every_rank(rows: list[int], n: int, engine: Engine) -> list[int]:
    """`rows` topped up with rows left out (in order) to the largest count of any rank: ZeRO-2 reduces
    gradients inside every backward pass, so every rank must run as many micro-batches. The added rows
    have zero loss and gradient, as the left-out rows always had; every rank holds n rows, so there are
    enough. One collective."""
    count = torch.tensor(float(len(rows)), dtype=torch.float64, device=engine.device)
    most = int(engine.all_reduce_max(count).item())
    chosen = set(rows)
    extra = [i for i in range(n) if i not in chosen][: most - len(rows)]
    return sorted(rows + extra)


def loss_settings(cfg: Config) -> LossSettings:
    """The policy loss's fixed hyper-parameters, built once per run from the typed config: each is the
    grpo key of the same name (LossSettings.from_knobs), so a knob is declared in GrpoConfig and algo only."""
    return LossSettings.from_knobs(vars(cfg.grpo))


def step_entropy_coef(grpo: GrpoConfig, coef: float, last_entropy: float) -> float:
    """The entropy bonus's coefficient this step: grpo.entropy_coef, or the adaptive controller's `coef`
    (applied only while the last step's entropy is below the target)."""
    if grpo.entropy_control == EntropyControl.FIXED:
        return grpo.entropy_coef
    return applied_entropy_coef(coef, last_entropy, target=grpo.entropy_target)


def policy_update(
    batch: TrainingBatch, stats: M.StepMetrics, run: UpdateSettings, models: UpdateModels, coefs: StepCoefs
) -> bool:
    """One optimizer step over the whole step's completions, accumulated over micro-batches; True when
    the engine skipped it for a non-finite loss or gradient. The caller tells the generation engine the
    weights changed (`GenerationEngine.policy_updated`). The loop's stop point (`models.stop`) runs before
    every micro-batch: a stop ends the pass there (StopRequested; the gradients accumulated so far are never
    used, and the caller keeps the state before this optimizer step: the step's start, or its last
    optimizer step with the step's rest)."""
    model, mask = models.engine.module, batch.loss_mask  # [N, T]
    # slices of rows, or packed row sets by token budget (trainer.padding_free)
    chunks = micro_batches_for(batch.rollout, models.forward, model, run.micro_batch_size)
    step_loss = torch.zeros((), dtype=torch.float64, device=mask.device)
    with models.forward.optimizer_step(model, len(chunks)):  # the weights stay fixed until engine.step()
        for mb in chunks:
            if models.stop is not None:  # every rank runs the same micro-batches: one flag, all ranks
                models.stop()
            loss = micro_batch_loss(batch, mb, stats, run, models, coefs)
            models.engine.backward(nonfinite_to_grad(loss))
            step_loss = step_loss + loss.detach()
    return optimizer_step(batch, stats, models.engine, coefs, run.grpo, step_loss)


def micro_batch_loss(
    batch: TrainingBatch,
    mb: slice,
    stats: M.StepMetrics,
    run: UpdateSettings,
    models: UpdateModels,
    coefs: StepCoefs,
) -> torch.Tensor:
    """The micro-batch's share of the step's loss (the policy loss, and a distillation form's own term),
    with gradient, its statistics recorded. []"""
    g, rollout = run.grpo, batch.rollout
    logprobs, entropy, student = student_pass(
        batch, models.forward, models.engine.module, mb, entropy_grad=coefs.entropy_coef > 0
    )
    t = logprobs.size(1)
    mask = batch.loss_mask[mb, :t]  # [n, T']
    old = logprobs.detach() if batch.old_logprobs is None else batch.old_logprobs[mb, :t]
    ref = None if batch.ref_logprobs is None else batch.ref_logprobs[mb, :t]
    weights = sampler_correction(rollout, mb, old, mask, stats, grpo=g)
    sampler = None if rollout.sampler_logprobs is None else rollout.sampler_logprobs[mb, :t]
    if sampler is not None and g.off_policy_loss == OffPolicyLoss.BYPASS:
        old, weights = sampler, None  # the clipped ratio against pi_sampler is the whole correction
    advantages = batch.advantages[mb]  # [n], or [n, T] per token (distillation)
    if advantages.dim() == 2:
        advantages = advantages[:, :t]  # [n, T']
    wants_entropy = coefs.entropy_coef > 0 or run.loss.top_entropy_quantile < 1.0
    inputs = LossInputs(
        logprobs,
        old,
        advantages,
        mask,
        ref_logprobs=ref,
        entropy=entropy if wants_entropy else None,
        token_weights=weights,
        behaviour_logprobs=sampler,
    )
    out = policy_loss(
        inputs, run.loss, beta=coefs.beta, normalizer=batch.normalizer, entropy_coef=coefs.entropy_coef
    )
    if student is not None:  # the distillation form's own loss term (distill.form=distribution)
        out = out._replace(
            loss=out.loss + run.distill.coef * teacher_term(batch, student, mb, mask, run, stats)
        )
    record_loss_stats(stats, out, mask, entropy, rollout.model_mask[mb, :t], g.beta > 0)
    record_variant_stats(stats, run.loss, out, mask)
    return out.loss


def optimizer_step(
    batch: TrainingBatch,
    stats: M.StepMetrics,
    engine: Engine,
    coefs: StepCoefs,
    grpo: GrpoConfig,
    step_loss: torch.Tensor,
) -> bool:
    """The engine's optimizer step on the accumulated gradients, and the step's update statistics; True
    when it was skipped for a non-finite gradient norm."""
    device = batch.loss_mask.device
    # Rows left out of the update are never clipped (A = 0): they only count in the denominators.
    for key in (M.CLIP_FRACTION, M.CLIP_FRACTION_LOW, M.CLIP_FRACTION_HIGH):
        stats.add_mean(key, 0.0, batch.skipped_loss_tokens)
    if grpo.entropy_control == EntropyControl.ADAPTIVE:
        stats.set_host(M.ENTROPY_COEF, coefs.entropy_coef)
    before = update_norm.snapshot(engine)  # this rank's share of the trainable weights (train/update_norm)
    grad_norm = engine.step()  # skips the update when the norm is not finite
    stats.add_sum(M.UPDATE_NORM_SQ, update_norm.moved_squared(before, device))
    skipped = not bool(torch.isfinite(grad_norm))  # the one host check of this optimizer step
    stats.add_sum(M.SKIPPED_STEPS, float(skipped))
    # Means over the μ iterations; the loss is summed over micro-batches (and ranks) first.
    stats.add_mean(M.LOSS, step_loss, 1.0 / engine.world_size)
    # The norm is already the whole step's on every rank: each rank contributes 1/world of it.
    stats.add_mean(M.GRAD_NORM, grad_norm / engine.world_size, 1.0 / engine.world_size)
    return skipped


def student_pass(
    batch: TrainingBatch, forward: TrainingForward, model, mb: MicroBatch, *, entropy_grad: bool
):
    """The micro-batch's (log-probs, entropy) [n, T'] with gradient, and where the batch carries the
    teacher's head states, the student's own at the same positions (one forward for both, padded: a
    packed micro-batch's rows run padded here), else None."""
    rollout = batch.rollout
    if batch.teacher_states is None:
        return (
            *logprobs_for(forward, model, rollout, mb, with_entropy=True, entropy_grad=entropy_grad),
            None,
        )
    p_ids, p_mask, c_ids, _ = trim_columns(
        rollout.prompt_ids[mb],
        rollout.prompt_mask[mb],
        rollout.completion_ids[mb],
        rollout.completion_mask[mb],
    )
    return forward.head_states(model, p_ids, p_mask, c_ids, with_entropy=True, entropy_grad=entropy_grad)


def teacher_term(
    batch: TrainingBatch,
    student: HeadStates,
    mb: MicroBatch,
    mask: torch.Tensor,
    run: UpdateSettings,
    stats: M.StepMetrics,
) -> torch.Tensor:
    """distill.form's loss term for the micro-batch (before distill.coef): its per-position term between
    the student's and the teacher's head states, aggregated like the policy loss over the step's
    denominator; the term's mean over loss tokens goes to the form's metric. []"""
    distill, loss = run.distill, run.loss
    form = DISTILL_FORMS[distill.form]
    assert form.loss_term is not None and batch.teacher_states is not None
    t = mask.size(1)
    teacher = batch.teacher_states._replace(hidden=batch.teacher_states.hidden[mb, :t])  # [n, T', H_t]
    knobs = {k: getattr(distill, k) for k in form_knobs(distill.form)}
    per_position = form.loss_term(student, teacher, mask, **knobs)  # [n, T']
    for key in form.metrics:
        stats.add_mean(key, per_position.detach().sum(), mask.sum())
    return aggregate(
        per_position,
        mask,
        loss.aggregation,
        normalizer=batch.normalizer,
        constant_length=loss.constant_length,
    )


def sampler_correction(
    rollout: Rollout,
    mb: MicroBatch,
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
        old,
        sampler,
        mask,
        mode=g.rollout_correction,
        cap=g.rollout_correction_cap,
        floor=g.rollout_correction_min,
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
    # Entropy: every sampled token of the rows in the update, in the loss or masked out of it
    # (the model's tokens only: a multi-turn episode's observations were not sampled).
    sampled = sampled_mask.float()  # [n, T']
    stats.add_mean(M.ENTROPY, masked_mean(entropy.detach(), sampled) * sampled.sum(), sampled.sum())


def record_variant_stats(stats: M.StepMetrics, settings: LossSettings, out, mask) -> None:
    """The shares of loss tokens the loss variants leave out, only for the knobs that are on."""
    tokens = mask.sum()
    if settings.top_entropy_quantile < 1.0:
        stats.add_mean(M.ENTROPY_KEPT_FRACTION, out.entropy_kept_fraction * tokens, tokens)
    if settings.off_policy_mask_threshold is not None:
        stats.add_mean(M.OFF_POLICY_MASKED_FRACTION, out.off_policy_masked_fraction * tokens, tokens)
    for name in POLICY_LOSSES[settings.policy_loss].metrics:  # the variant's own, e.g. dppo's trust region
        stats.add_mean(f"train/{name}", getattr(out, name) * tokens, tokens)


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
