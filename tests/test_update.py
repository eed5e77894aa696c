"""Leaving zero-advantage rows out of the update is an optimisation, not a change: the same gradient,
the same loss and the same clip fractions as running every row through the forward/backward."""

import contextlib
import functools
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from hydra import compose, initialize_config_dir

from grpo_run import metrics as M
from grpo_run.algo import PolicyLoss
from grpo_run.backend import training_forward
from grpo_run.cli import CONF_DIR
from grpo_run.config import register_configs, to_config
from grpo_run.models.tiny import build_model, build_tokenizer
from grpo_run.passes import frozen_logprobs, old_and_reference_logprobs
from grpo_run.rollout.engines import TransformersEngine
from grpo_run.rollout.filtering import loss_mask, rows_with_gradient
from grpo_run.rollout.generate import Rollout
from grpo_run.safety.stop import StopRequested, request_stop, stop_point
from grpo_run.teacher import FrozenTeacher
from grpo_run.update import (
    StepCoefs,
    StepInputs,
    TrainingBatch,
    UpdateModels,
    UpdateSettings,
    distilled_batch,
    loss_normalizer,
    policy_update,
    rows_to_train,
    skips_zero_advantage_rows,
    step_entropy_coef,
    training_batch,
)

register_configs()
B, G, P, T = 4, 4, 5, 6
SHAPE = ["model=tiny", f"trainer.prompts_per_step={B}", f"grpo.group_size={G}", "trainer.micro_batch_size=4"]


class RecordingEngine:
    """One process, no optimizer: `step` keeps the accumulated gradient for comparison."""

    rank = 0
    world_size = 1

    def __init__(self, model):
        self.module = model
        self.grads: dict[str, torch.Tensor] = {}

    def backward(self, loss):
        loss.backward()

    def step(self):
        self.grads = {n: p.grad.clone() for n, p in self.module.named_parameters()}
        self.module.zero_grad(set_to_none=True)
        return torch.linalg.vector_norm(torch.stack([g.norm() for g in self.grads.values()]))

    def all_reduce_sum(self, x):
        return x

    def all_reduce_max(self, x):
        return x

    def broadcast_flag(self, flag: bool) -> bool:
        return flag


def make_ctx(overrides: list[str]):
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = to_config(compose(config_name="config", overrides=[*SHAPE, *overrides]))
    model = build_model(build_tokenizer(), seed=0)
    device = torch.device("cpu")
    return SimpleNamespace(
        cfg=cfg,
        engine=RecordingEngine(model),
        generation=TransformersEngine(model, eos_id=1, pad_id=0, autocast_bf16=False),
        forward=training_forward(cfg, device),
        device=device,
    )


def make_batch(ctx) -> TrainingBatch:
    vocab = ctx.engine.module.config.vocab_size
    gen = torch.Generator().manual_seed(3)
    n = B * G
    completion_mask = torch.ones(n, T, dtype=torch.long)
    completion_mask[1, 3:] = 0  # a short completion
    completion_mask[6, 2:] = 0
    rollout = Rollout(
        prompt_ids=torch.randint(1, vocab, (n, P), generator=gen),
        prompt_mask=torch.ones(n, P, dtype=torch.long),
        completion_ids=torch.randint(1, vocab, (n, T), generator=gen) * completion_mask,
        completion_mask=completion_mask,
        truncated=torch.zeros(n, dtype=torch.bool),
    )
    # Groups 0 and 2 have equal rewards (advantage 0); groups 1 and 3 carry signal.
    rewards = torch.tensor([[0.0] * G, [1.0, 0.0, 0.0, 1.0], [1.0] * G, [0.0, 0.5, 1.0, 0.0]])
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    advantages = (centred / (rewards.std(dim=1, unbiased=False, keepdim=True) + 1e-4)).flatten()
    mask = loss_mask(rollout, False)
    g = ctx.cfg.grpo
    normalizer = loss_normalizer(mask, g.aggregation)
    skip = skips_zero_advantage_rows(UpdateSettings.of(ctx.cfg), StepCoefs(g.beta, entropy_coef(ctx)))
    rollout, advantages, kept, skipped = rows_to_train(rollout, advantages, mask, skip=skip)
    return TrainingBatch(rollout, advantages, kept, normalizer, None, None, skipped)


def entropy_coef(ctx) -> float:
    """The first step's coefficient: no entropy measured yet."""
    return step_entropy_coef(ctx.cfg.grpo, ctx.cfg.grpo.entropy_coef, float("inf"))


def update(ctx, batch: TrainingBatch, stats: M.StepMetrics) -> None:
    models = UpdateModels(ctx.engine, ctx.forward, ctx.engine.module)
    coefs = StepCoefs(ctx.cfg.grpo.beta, entropy_coef(ctx))
    policy_update(batch, stats, UpdateSettings.of(ctx.cfg), models, coefs)


def run_update(overrides: list[str]):
    ctx = make_ctx(overrides)
    stats = M.StepMetrics(ctx.device)
    batch = make_batch(ctx)
    update(ctx, batch, stats)
    return ctx.engine.grads, stats.reduce(ctx.engine), batch.advantages.numel()


@pytest.mark.parametrize("aggregation", ["per_response", "per_token", "constant_length"])
def test_skipping_zero_advantage_rows_leaves_gradient_loss_and_clip_fractions_unchanged(aggregation):
    common = [f"aggregation={aggregation}", "trainer.micro_batch_size=4"]
    full_grads, full_metrics, full_rows = run_update([*common, "trainer.skip_zero_advantage=false"])
    grads, metrics, rows = run_update([*common, "trainer.skip_zero_advantage=true"])
    assert (full_rows, rows) == (16, 8)  # groups 0 and 2 never reach the forward pass
    for name, g in full_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-7, msg=name)
    assert metrics[M.LOSS] == pytest.approx(full_metrics[M.LOSS], rel=1e-5, abs=1e-8)
    for key in (M.CLIP_FRACTION, M.CLIP_FRACTION_LOW, M.CLIP_FRACTION_HIGH):
        assert metrics[key] == pytest.approx(full_metrics[key], abs=1e-12)


@pytest.mark.parametrize("override", ["grpo.beta=0.04", "grpo.entropy_coef=0.01"])
def test_rows_are_kept_when_they_carry_gradient_anyway(override):
    # β > 0 (the KL term) or an entropy bonus: a zero-advantage row still has a gradient.
    *_, rows = run_update([override, "trainer.skip_zero_advantage=true"])
    assert rows == 16


def test_rows_with_gradient():
    adv = torch.tensor([0.0, 1.5, -0.5, 0.0, 2.0])
    mask = torch.tensor([[1, 1], [1, 0], [0, 0], [1, 1], [1, 1]]).float()
    # row 0 and 3: advantage 0; row 2: no loss token (masked as truncated).
    assert rows_with_gradient(adv, mask) == [1, 4]
    # Nothing to learn from: one row is still run, so every parameter gets a zero gradient and
    # AdamW's momentum step happens exactly as if every row had been run.
    assert rows_with_gradient(torch.zeros(3), torch.ones(3, 2)) == [0]


# --- the policy-loss variants through the real update ---------------------------------------------


def off_policy_batch(ctx) -> TrainingBatch:
    """make_batch with π_old computed by the update's own forward (μ > 1) and then moved by noise, so
    ratios leave 1 and every variant's clipping, gating or masking is exercised."""
    batch = make_batch(ctx)
    old, _ = old_and_reference_logprobs(
        batch.rollout,
        forward=ctx.forward,
        old=ctx.engine.module,
        reference=None,
        micro_batch_size=ctx.cfg.trainer.micro_batch_size,
    )
    gen = torch.Generator().manual_seed(5)
    batch.old_logprobs = (old + 0.4 * torch.randn(old.shape, generator=gen)).clamp(max=-1e-3)  # [N, T]
    return batch


def update_with(overrides: list[str]):
    ctx = make_ctx(["grpo.num_iterations=2", *overrides])
    stats = M.StepMetrics(ctx.device)
    update(ctx, off_policy_batch(ctx), stats)
    return ctx.engine.grads, stats.reduce(ctx.engine)


VARIANT_KEYS = [
    M.ENTROPY_KEPT_FRACTION,
    M.OFF_POLICY_MASKED_FRACTION,
    M.TRUST_REGION_MASKED_FRACTION,
    M.ENTROPY_COEF,
]


@pytest.mark.parametrize("aggregation", ["per_response", "per_token"])
@pytest.mark.parametrize("loss", [p.value for p in PolicyLoss])
def test_every_policy_loss_splits_into_micro_batches_exactly(loss, aggregation):
    # One micro-batch of 16 or four of 4: the step's normaliser makes the gradient and loss the same.
    common = [f"grpo.policy_loss={loss}", f"aggregation={aggregation}", "trainer.skip_zero_advantage=false"]
    if loss.startswith("dppo"):  # the tiny model's token probabilities are ~1/vocab: a region to match
        common += ["grpo.trust_region_low=5e-4", "grpo.trust_region_high=5e-4"]
    whole_grads, whole = update_with([*common, "trainer.micro_batch_size=16"])
    grads, split = update_with([*common, "trainer.micro_batch_size=4"])
    for name, g in whole_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-7, msg=name)
    assert split[M.LOSS] == pytest.approx(whole[M.LOSS], rel=1e-5, abs=1e-8)
    assert any(g.abs().sum() > 0 for g in grads.values())
    dppo = loss.startswith("dppo")
    assert (M.TRUST_REGION_MASKED_FRACTION in split) == dppo
    if dppo:
        assert 0 < split[M.TRUST_REGION_MASKED_FRACTION] < 1
    assert not {M.ENTROPY_KEPT_FRACTION, M.OFF_POLICY_MASKED_FRACTION, M.ENTROPY_COEF} & set(split)


def test_default_update_logs_no_variant_metric():
    _, metrics = update_with([])
    assert not set(VARIANT_KEYS) & set(metrics)


def test_knobs_log_their_shares():
    _, metrics = update_with(
        [
            "grpo.top_entropy_quantile=0.2",
            "grpo.off_policy_mask_threshold=0.0",
            "grpo.entropy_control=adaptive",
        ]
    )
    # each micro-batch keeps its top 20% of loss tokens by entropy (ties aside)
    assert metrics[M.ENTROPY_KEPT_FRACTION] == pytest.approx(0.2, abs=0.05)
    assert 0 < metrics[M.OFF_POLICY_MASKED_FRACTION] < 1
    assert metrics[M.ENTROPY_COEF] == 0.0  # no entropy measured yet: the first step applies none


def test_top_entropy_quantile_and_adaptive_entropy_keep_zero_advantage_rows():
    # The quantile is taken over every loss token of a micro-batch, and the adaptive bonus acts on all rows.
    for override in ("grpo.top_entropy_quantile=0.5", "grpo.entropy_control=adaptive"):
        *_, rows = run_update([override, "trainer.skip_zero_advantage=true"])
        assert rows == 16


# --- off-policy rows: the sampler's log-probs as pi_behaviour (rollout=async, vLLM) -------------------


def with_sampler(batch: TrainingBatch, sampler: torch.Tensor) -> TrainingBatch:
    batch.rollout.sampler_logprobs = sampler * batch.rollout.completion_mask  # [N, T], 0 off the mask
    return batch


def grads_of(overrides: list[str], prepare) -> dict[str, torch.Tensor]:
    ctx = make_ctx(overrides)
    update(ctx, prepare(ctx, off_policy_batch(ctx)), M.StepMetrics(ctx.device))
    return ctx.engine.grads


def test_bypass_takes_the_ratio_against_the_sampler_log_probs():
    """off_policy_loss=bypass: the update with pi_behaviour attached equals the plain update whose pi_old
    *is* pi_behaviour (and no correction weight), bit for bit."""
    common = ["grpo.num_iterations=2", "trainer.micro_batch_size=4"]

    def behaviour(batch):  # another policy than pi_old: pi_old moved by more noise
        gen = torch.Generator().manual_seed(11)
        return (batch.old_logprobs + 0.3 * torch.randn(batch.old_logprobs.shape, generator=gen)).clamp(
            max=-1e-3
        )

    def attached(ctx, batch):
        return with_sampler(batch, behaviour(batch))

    def as_old(ctx, batch):
        batch.old_logprobs = behaviour(batch) * batch.rollout.completion_mask
        return batch

    bypass = grads_of([*common, "grpo.off_policy_loss=bypass"], attached)
    plain = grads_of(common, as_old)
    decoupled = grads_of(common, attached)
    for name, g in plain.items():
        assert torch.equal(bypass[name], g), name
    assert any(not torch.equal(decoupled[n], g) for n, g in plain.items())  # the two forms differ


@pytest.mark.parametrize("mode", ["decoupled", "bypass"])
def test_with_the_sampler_equal_to_pi_old_both_forms_are_todays_loss_exactly(mode):
    """Staleness 0 (pi_behaviour = pi_old): the behaviour weight is exactly 1 and the bypass ratio is the
    plain one, so both give the gradients of the update without sampler log-probs."""
    common = ["grpo.num_iterations=2", "trainer.micro_batch_size=4"]
    today = grads_of(common, lambda ctx, batch: batch)
    same = grads_of(
        [*common, f"grpo.off_policy_loss={mode}", "grpo.rollout_correction=token_tis"],
        lambda ctx, batch: with_sampler(batch, batch.old_logprobs),
    )
    for name, g in today.items():
        assert torch.equal(same[name], g), name


# On-policy distillation (distill=teacher | self): the teacher's stage and the update's per-token advantages.
def distilled(ctx, batch: TrainingBatch, teacher_model, stats: M.StepMetrics, between=None) -> TrainingBatch:
    """The teacher's stage after the student's pass that training_batch(distilling=True) runs at μ = 1."""
    student = frozen_logprobs(
        batch.rollout,
        forward=ctx.forward,
        model=ctx.engine.module,
        micro_batch_size=ctx.cfg.trainer.micro_batch_size,
    )
    teacher = FrozenTeacher(teacher_model.eval(), ctx.forward, ctx.device, micro_batch_size=4)
    return distilled_batch(
        replace(batch, student_logprobs=student),
        [],  # a frozen teacher reads no example
        stats,
        teacher=teacher,
        distill=ctx.cfg.distill,
        between=between,
    )


def with_observations(batch: TrainingBatch) -> TrainingBatch:
    """Rows 0-3 hold a tool's observation at completion tokens 2 and 3 (trainable 0, out of the loss)."""
    trainable = torch.ones_like(batch.rollout.completion_mask)
    trainable[:4, 2:4] = 0
    rollout = replace(batch.rollout, trainable_mask=trainable)
    return replace(batch, rollout=rollout, loss_mask=loss_mask(rollout, False))


DISTILL = ["distill=teacher", "distill.teacher.path=org/teacher", "trainer.skip_zero_advantage=false"]


def test_observation_and_padding_tokens_get_no_teacher_term():
    ctx = make_ctx([*DISTILL, "distill.discount=0.5", "distill.reward_weight=0.5"])
    stats = M.StepMetrics(ctx.device)
    batch = with_observations(make_batch(ctx))
    out = distilled(ctx, batch, build_model(build_tokenizer(), seed=1), stats)
    assert out.advantages.shape == batch.loss_mask.shape
    assert not out.advantages[batch.loss_mask == 0].any()  # observations, padding: exactly 0
    assert out.advantages[batch.loss_mask == 1].ne(0).all()  # another teacher: every model token has one
    metrics = stats.reduce(ctx.engine)
    assert metrics[M.DISTILL_TEACHER_KL] != 0 and metrics[M.DISTILL_TEACHER_S] >= 0


@pytest.mark.parametrize("form", ["advantage", "distribution"])
def test_a_teacher_equal_to_the_student_gives_zero_kl_and_with_reward_weight_0_no_gradient(form):
    ctx = make_ctx([*DISTILL, f"distill.form={form}"])
    stats = M.StepMetrics(ctx.device)
    batch = distilled(ctx, with_observations(make_batch(ctx)), ctx.engine.module, stats)
    assert not batch.advantages.any()  # the task advantage weighted by 0, the teacher term 0
    update(ctx, batch, stats)
    metrics = stats.reduce(ctx.engine)
    assert metrics[M.DISTILL_TEACHER_KL] == 0.0 and metrics[M.DISTILL_TEACHER_LOGRATIO] == 0.0
    if form == "advantage":
        assert not any(g.any() for g in ctx.engine.grads.values())
    else:  # the divergence and its gradient are 0 up to the rounding of two passes through the heads
        assert abs(metrics[M.DISTILL_DIVERGENCE]) < 1e-6
        assert max(g.abs().max().item() for g in ctx.engine.grads.values()) < 1e-5


@pytest.mark.parametrize("form", ["advantage", "distribution"])
def test_distillation_splits_into_micro_batches_exactly(form):
    """Per-token advantages and the teacher's loss term are cut with their micro-batch's columns."""
    grads = {}
    for size in (4, 16):
        ctx = make_ctx(
            [*DISTILL, f"distill.form={form}", "distill.reward_weight=1", f"trainer.micro_batch_size={size}"]
        )
        stats = M.StepMetrics(ctx.device)
        update(ctx, distilled(ctx, make_batch(ctx), build_model(build_tokenizer(), seed=1), stats), stats)
        grads[size] = ctx.engine.grads
    for name, g in grads[16].items():
        torch.testing.assert_close(grads[4][name], g, rtol=1e-5, atol=1e-7)
    assert any(g.any() for g in grads[16].values())


# A stop during the no-gradient passes (π_old, π_ref, the teacher's) ends them between micro-batches.
def counting_forwards(forward) -> list[torch.nn.Module]:
    """The model of each `forward.logprobs` call from now on (one per micro-batch of a scoring pass)."""
    calls: list[torch.nn.Module] = []
    original = forward.logprobs

    def counted(model, *args, **kwargs):
        calls.append(model)
        return original(model, *args, **kwargs)

    forward.logprobs = counted
    return calls


def test_a_no_gradient_pass_calls_between_before_each_micro_batch_and_ends_when_it_raises():
    ctx = make_ctx(["trainer.skip_zero_advantage=false", "trainer.padding_free=false"])
    batch = make_batch(ctx)  # 16 rows: 4 micro-batches of 4
    calls = counting_forwards(ctx.forward)
    seen: list[int] = []

    def between():
        seen.append(len(calls))  # the micro-batches run before this call
        if len(seen) == 3:
            raise StopRequested

    with pytest.raises(StopRequested):
        frozen_logprobs(
            batch.rollout, forward=ctx.forward, model=ctx.engine.module, micro_batch_size=4, between=between
        )
    assert seen == [0, 1, 2] and len(calls) == 2  # the third micro-batch never ran


@pytest.fixture
def stop_requested():
    request_stop()  # tests/conftest.py forgets it after the test


@pytest.mark.parametrize("padding_free", ["false", "true"])
def test_a_stop_ends_the_reference_pass_before_its_first_forward(stop_requested, padding_free):
    # packed: before the first step's check too (its forwards are `logprobs` and `packed_logprobs`)
    ctx = make_ctx(["grpo.beta=0.04", f"trainer.padding_free={padding_free}"])
    batch = make_batch(ctx)
    reference = build_model(build_tokenizer(), seed=1)
    calls = counting_forwards(ctx.forward)
    ctx.forward.packed_logprobs = lambda model, *args, **kwargs: calls.append(model)
    with pytest.raises(StopRequested):
        models = UpdateModels(
            ctx.engine,
            ctx.forward,
            ctx.engine.module,
            reference=lambda: contextlib.nullcontext(reference),
            stop=functools.partial(stop_point, ctx.engine.broadcast_flag),
        )
        inputs = StepInputs(batch.rollout, batch.advantages, batch.loss_mask)
        training_batch(
            inputs, M.StepMetrics(ctx.device), UpdateSettings.of(ctx.cfg), models, StepCoefs(0.04, 0.0)
        )
    assert not calls


def test_a_stop_ends_the_teachers_pass_before_its_first_forward():
    ctx = make_ctx([*DISTILL, "trainer.padding_free=false"])  # padded: 4 micro-batches of 4
    teacher = build_model(build_tokenizer(), seed=1)
    calls = counting_forwards(ctx.forward)
    between = functools.partial(stop_point, ctx.engine.broadcast_flag)
    batch = distilled(ctx, make_batch(ctx), teacher, M.StepMetrics(ctx.device), between=between)
    assert sum(m is teacher for m in calls) == 4  # no stop: 16 rows in micro-batches of 4
    request_stop()  # tests/conftest.py forgets it after the test
    with pytest.raises(StopRequested):
        distilled(ctx, make_batch(ctx), teacher, M.StepMetrics(ctx.device), between=between)
    assert sum(m is teacher for m in calls) == 4 and batch.advantages.any()
