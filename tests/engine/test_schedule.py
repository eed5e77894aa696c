"""The LR multiplier per optimizer step (grpo_run/engine/schedule.py), worked numbers, and the engine using it."""

import pytest
import torch

from grpo_run.config.schema import LRScheduler
from grpo_run.engine import SingleProcessEngine
from grpo_run.engine.schedule import lr_factor


def factors(kind: LRScheduler, warmup: int, total: int) -> list[float]:
    f = lr_factor(kind, warmup_steps=warmup, max_steps=total)
    return [f(s) for s in range(total)]


def test_worked_numbers_without_warmup():
    # 4 steps, k = 0..3: linear (4 - k)/4; cosine (1 + cos(pi k/4))/2 = 1, (1 + 0.7071)/2, 0.5, (1 - 0.7071)/2
    assert factors(LRScheduler.CONSTANT, 0, 4) == [1.0, 1.0, 1.0, 1.0]
    assert factors(LRScheduler.LINEAR, 0, 4) == pytest.approx([1.0, 0.75, 0.5, 0.25])
    assert factors(LRScheduler.COSINE, 0, 4) == pytest.approx([1.0, 0.853553, 0.5, 0.146447], abs=1e-6)


def test_warmup_then_decay():
    # W = 2: (s+1)/3 for s = 0, 1; then D = 6 - 2 = 4 decay steps as above
    assert factors(LRScheduler.LINEAR, 2, 6) == pytest.approx([1 / 3, 2 / 3, 1.0, 0.75, 0.5, 0.25])
    assert factors(LRScheduler.CONSTANT, 2, 6) == pytest.approx([1 / 3, 2 / 3, 1, 1, 1, 1])
    # past max_steps (a run resumed with more steps than it planned) the decay stays at its end, never negative
    assert lr_factor(LRScheduler.LINEAR, warmup_steps=0, max_steps=4)(9) == 0.0


def test_the_engine_steps_at_lr_times_factor():
    model = torch.nn.Linear(2, 1)
    engine = SingleProcessEngine(
        model,
        lr=0.1,
        weight_decay=0.0,
        betas=(0.9, 0.99),
        lr_factor=lr_factor(LRScheduler.LINEAR, warmup_steps=0, max_steps=4),
        max_grad_norm=1.0,
        device=torch.device("cpu"),
    )
    seen = []
    for _ in range(4):
        seen.append(engine.current_lr())
        engine.backward(model(torch.ones(1, 2)).sum())
        engine.step()
    assert seen == pytest.approx([0.1, 0.075, 0.05, 0.025])


def test_set_base_lr_keeps_the_schedule_position_and_survives_a_save(tmp_path):
    def linear_engine(lr: float) -> SingleProcessEngine:
        torch.manual_seed(0)
        return SingleProcessEngine(
            torch.nn.Linear(2, 1),
            lr=lr,
            weight_decay=0.0,
            betas=(0.9, 0.99),
            lr_factor=lr_factor(LRScheduler.LINEAR, warmup_steps=0, max_steps=4),
            max_grad_norm=1.0,
            device=torch.device("cpu"),
        )

    def one_step(engine: SingleProcessEngine) -> float:
        lr = engine.current_lr()
        engine.backward(engine.module(torch.ones(1, 2)).sum())
        engine.step()
        return lr

    engine = linear_engine(0.1)
    assert [one_step(engine) for _ in range(2)] == pytest.approx([0.1, 0.075])  # factors 1, 0.75
    engine.save_state(tmp_path)
    resumed = linear_engine(0.1)
    resumed.load_state(tmp_path)
    # A resume with trainer.lr=0.2: the schedule stands at factor 0.5, so 0.2 · 0.5, then 0.2 · 0.25.
    resumed.set_base_lr(0.2)
    assert resumed.current_lr() == pytest.approx(0.1)
    assert [one_step(resumed) for _ in range(2)] == pytest.approx([0.1, 0.05])
    # The same lr changes nothing: 0.1 · 0.5 and 0.1 · 0.25, as if never resumed.
    same = linear_engine(0.1)
    same.load_state(tmp_path)
    same.set_base_lr(0.1)
    assert (
        [one_step(same) for _ in range(2)]
        == [one_step(engine) for _ in range(2)]
        == pytest.approx([0.05, 0.025])
    )
