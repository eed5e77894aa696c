"""The whole update packed against padded: the same loss, metrics and gradients for every aggregation,
with π_old (μ = 2), π_ref (β > 0) and an entropy bonus, on the native forward and transformers'; a row
longer than the budget trains in a micro-batch of its own; and trainer.padding_free=false runs today's
micro-batches."""

import contextlib

import pytest
import torch
from transformers import AutoModelForCausalLM

from grpo_run import metrics as M
from grpo_run import micro_batches as rollout_micro_batches
from grpo_run import update
from grpo_run.algo import compute_advantages
from grpo_run.backend import training_forward
from grpo_run.models.tiny import ensure_tiny_model
from grpo_run.rollout.filtering import loss_mask
from tests.builders import compose_config
from tests.native.test_update_gradients import CPU, RecordingEngine, default_run_batch

# The metrics both paths must report alike (timings and counts of micro-batches aside).
COMPARED = (M.LOSS, M.KL, M.ENTROPY, M.CLIP_FRACTION, M.GRAD_NORM)


def one_update(cfg, model, reference, rollout, rewards):
    """One step's update with `cfg`'s forward (π_old when μ > 1, π_ref from `reference` when β > 0):
    (metrics, gradients, the micro-batches' sizes)."""
    g = cfg.grpo
    advantages = compute_advantages(rewards, g.advantage_mode, g.std_correction, g.advantage_eps).reshape(-1)
    mask = loss_mask(rollout, g.mask_truncated)
    engine, forward = RecordingEngine(model), training_forward(cfg, CPU)
    stats = M.StepMetrics(CPU)
    run, coefs = update.UpdateSettings.of(cfg), update.StepCoefs(g.beta, g.entropy_coef)
    ref = (lambda: contextlib.nullcontext(reference)) if g.beta > 0 else None
    models = update.UpdateModels(engine, forward, model, reference=ref)
    batch = update.training_batch(update.StepInputs(rollout, advantages, mask), stats, run, models, coefs)
    update.policy_update(batch, stats, run, models, coefs)
    values = stats.reduce(engine)
    return {k: values[k] for k in COMPARED if k in values}, engine.grads, forward


@pytest.fixture(scope="module")
def models(_cache_dir):
    path = ensure_tiny_model(_cache_dir)
    policy = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).train()
    torch.manual_seed(5)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():  # a reference that differs from the policy, so that the KL term is not 0
        for p in reference.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return policy, reference


@pytest.mark.parametrize("aggregation", ["per_response", "per_token", "constant_length"])
@pytest.mark.parametrize("backend", ["native", "plain"])
def test_the_packed_update_equals_the_padded_one(models, aggregation, backend):
    policy, reference = models
    base = [
        "model=tiny",
        "trainer.device=cpu",
        f"backend={backend}",
        f"aggregation={aggregation}",
        "grpo.beta=0.04",
        "grpo.num_iterations=2",
        "grpo.entropy_coef=0.01",
        "trainer.micro_batch_tokens=600",  # several packed micro-batches, not as the padded path cuts them
    ]
    cfg_packed = compose_config([*base, "trainer.padding_free=true"])
    cfg_padded = compose_config([*base, "trainer.padding_free=false"])
    rollout, rewards = default_run_batch(cfg_packed, policy.config.vocab_size, policy.config.eos_token_id, 0)
    packed, packed_grads, forward = one_update(cfg_packed, policy, reference, rollout, rewards)
    padded, padded_grads, plain = one_update(cfg_padded, policy, reference, rollout, rewards)
    assert plain.packing is None
    assert forward.packing.checked and forward.packing.enabled
    assert forward.packing.largest_difference <= 1e-5
    assert packed.keys() == padded.keys() and M.KL in packed and M.ENTROPY in packed
    for key, want in padded.items():
        assert packed[key] == pytest.approx(want, rel=1e-5, abs=1e-7), key
    for name, want in padded_grads.items():
        assert (packed_grads[name] - want).abs().max() <= 1e-5 * want.abs().max(), name


def test_packed_micro_batches_follow_the_token_budget(models, monkeypatch):
    """A budget of 1 token-equivalent: every row is over it and gets a micro-batch of its own (never
    dropped); the default budget (micro_batch_size x the longest row) packs the 64 rows into fewer
    micro-batches than the 4 of 16 rows the padded path runs."""
    policy, reference = models
    sizes = []
    real = rollout_micro_batches.micro_batches_for

    def recorded(*args, **kwargs):
        plans = real(*args, **kwargs)
        sizes.append([len(p) if isinstance(p, torch.Tensor) else p.stop - p.start for p in plans])
        return plans

    monkeypatch.setattr(update, "micro_batches_for", recorded)
    base = ["model=tiny", "trainer.device=cpu", "trainer.skip_zero_advantage=false"]
    cfg = compose_config([*base, "trainer.padding_free=true", "trainer.micro_batch_tokens=1"])
    rollout, rewards = default_run_batch(cfg, policy.config.vocab_size, policy.config.eos_token_id, 0)
    over, over_grads, _ = one_update(cfg, policy, reference, rollout, rewards)
    assert sizes[-1] == [1] * 64
    padded, padded_grads, _ = one_update(
        compose_config([*base, "trainer.padding_free=false"]), policy, reference, rollout, rewards
    )
    assert sizes[-1] == [16] * 4
    one_update(compose_config([*base, "trainer.padding_free=true"]), policy, reference, rollout, rewards)
    assert sum(sizes[-1]) == 64 and len(sizes[-1]) < 4
    assert over[M.LOSS] == pytest.approx(padded[M.LOSS], abs=1e-7)  # ~0 at μ = 1: ratio 1, mean A 0
    for name, want in padded_grads.items():
        assert (over_grads[name] - want).abs().max() <= 1e-5 * want.abs().max(), name
