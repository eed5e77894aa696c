"""env.call_cost's math (grpo_run/rewards/call_cost.py): the two forms on worked numbers, the margin check,
the levels derived from weighted reward terms, and a seeded sweep: every accepted cost keeps every correct
episode above every wrong one."""

import random

import pytest

from grpo_run.rewards.call_cost import (
    CostForm,
    call_cost_reward,
    cost_reward,
    derived_levels,
    margin_problem,
)

MUL, ADD = CostForm.MULTIPLICATIVE, CostForm.ADDITIVE


def test_worked_numbers():
    assert cost_reward(1.0, 2, 0.1, MUL) == pytest.approx(0.81)
    assert cost_reward(1.0, 2, 0.1, ADD) == pytest.approx(0.8)
    assert cost_reward(0.5, 0, 0.3, MUL) == 0.5 and cost_reward(0.5, 0, 0.3, ADD) == 0.5


def test_multiplicative_leaves_a_wrong_answer_where_it_is_and_unscorable_stays_none():
    assert call_cost_reward([0.0, -0.5, None, 2.0], [3, 2, 4, 1], 0.5, MUL) == [0.0, -0.5, None, 1.0]
    assert call_cost_reward([0.0, -0.5, None, 2.0], [3, 2, 4, 1], 0.5, ADD) == [-1.5, -1.5, None, 1.5]


def test_the_margin_check_at_its_boundary():
    # additive: c x K must stay below correct_min - wrong_max = 1
    assert margin_problem((0.0, 1.0), 0.24, ADD, 4) is None
    why = margin_problem((0.0, 1.0), 0.25, ADD, 4)
    assert why is not None and "0.25 x 4 = 1" in why and "margin 1" in why
    # multiplicative: (1 - c)**K x correct_min must stay above wrong_max = 0.1
    assert margin_problem((0.1, 1.0), 0.4, MUL, 4) is None  # 0.6**4 = 0.1296
    why = margin_problem((0.1, 1.0), 0.5, MUL, 4)  # 0.5**4 = 0.0625
    assert why is not None and "0.0625" in why
    # wrong_max <= 0 and correct_min > 0: any multiplicative cost < 1 keeps correct answers ahead
    assert margin_problem((0.0, 1.0), 0.99, MUL, 8) is None
    # no margin at all: refused whatever the cost
    assert "does not exceed" in margin_problem((1.0, 1.0), 0.01, ADD, 1)


def test_levels_derived_from_weighted_terms():
    unit = (0.0, 1.0)
    assert derived_levels([(1.0, True, None)]) == (0.0, 1.0)  # math_verifier alone
    assert derived_levels([(1.0, True, None), (0.1, False, unit)]) == (0.1, 1.0)  # + format at 0.1
    assert derived_levels([(1.0, True, None), (1.0, False, (-0.5, 0.0))]) == (0.0, 0.5)  # + overlong
    assert derived_levels([(2.0, True, None), (-1.0, False, unit)]) == (0.0, 1.0)  # a negative weight
    assert derived_levels([(1.0, False, unit)]) is None  # no gold check
    assert derived_levels([(1.0, True, None), (1.0, False, None)]) is None  # a range unknown


def test_every_accepted_cost_keeps_every_correct_episode_above_every_wrong_one():
    """A seeded sweep (a few thousand cases): random levels, costs near and far from the boundary, both
    forms, K calls at most; each side's rewards at its level's edge and inside its range, calls 0..K."""
    rng = random.Random(66)
    accepted = refused = 0
    for _ in range(4000):
        wrong_max = rng.choice([0.0, rng.uniform(-2, 2)])
        correct_min = wrong_max + rng.choice([rng.uniform(1e-3, 3), 1.0])
        form = rng.choice([MUL, ADD])
        k_max = rng.randint(1, 8)
        margin = correct_min - wrong_max
        if form == ADD:
            cost = rng.choice([rng.uniform(0, 2 * margin / k_max), margin / k_max, margin / k_max * 0.999])
        else:
            cost = rng.choice([rng.uniform(0, 0.999), 0.0, 1 - 1e-9])
        if margin_problem((wrong_max, correct_min), cost, form, k_max) is not None:
            refused += 1
            continue
        accepted += 1
        correct = [correct_min, correct_min + rng.uniform(0, 2)]
        wrong = [wrong_max, wrong_max - rng.uniform(0, 2)]
        for k in range(k_max + 1):
            for j in range(k_max + 1):
                worst_correct = min(cost_reward(r, k, cost, form) for r in correct)
                best_wrong = max(cost_reward(r, j, cost, form) for r in wrong)
                assert worst_correct > best_wrong, (wrong_max, correct_min, cost, form, k_max, k, j)
    assert accepted > 1000 and refused > 200  # the sweep covers both sides of the boundary
