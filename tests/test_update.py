"""Leaving zero-advantage rows out of the update is an optimisation, not a change: the same gradient,
the same loss and the same clip fractions as running every row through the forward/backward."""

from types import SimpleNamespace

import pytest
import torch
from hydra import compose, initialize_config_dir

from grpo_run import metrics as M
from grpo_run.backend import training_forward
from grpo_run.cli import CONF_DIR
from grpo_run.config import register_configs, to_config
from grpo_run.models.tiny import build_model, build_tokenizer
from grpo_run.rollout.engines import TransformersEngine
from grpo_run.rollout.filtering import loss_mask, rows_with_gradient
from grpo_run.rollout.generate import Rollout
from grpo_run.update import TrainingBatch, loss_normalizer, policy_update, rows_to_train

register_configs()
B, G, P, T = 4, 4, 5, 6
SHAPE = ["model=tiny", f"trainer.prompts_per_step={B}", f"grpo.group_size={G}", "trainer.micro_batch_size=4"]


class RecordingEngine:
    """One process, no optimizer: `step` keeps the accumulated gradient for comparison."""

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
    skip = ctx.cfg.trainer.skip_zero_advantage and g.beta == 0 and g.entropy_coef == 0
    rollout, advantages, kept, skipped = rows_to_train(rollout, advantages, mask, skip=skip)
    return TrainingBatch(rollout, advantages, kept, normalizer, None, None, skipped)


def run_update(overrides: list[str]):
    ctx = make_ctx(overrides)
    stats = M.StepMetrics(ctx.device)
    batch = make_batch(ctx)
    policy_update(
        batch,
        stats,
        grpo=ctx.cfg.grpo,
        beta=ctx.cfg.grpo.beta,
        micro_batch_size=ctx.cfg.trainer.micro_batch_size,
        engine=ctx.engine,
        forward=ctx.forward,
        generation=ctx.generation,
    )
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
