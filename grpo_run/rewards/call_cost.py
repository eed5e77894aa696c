"""A cost per tool call (`env.call_cost`, `env.cost_form`), and the check that it never outranks correctness.

An episode's reward r with k tool calls becomes, for a cost c:
- multiplicative (OTC's form, Wang et al. 2025, "Acting Less is Reasoning More"): r * (1 - c)**k when
  r > 0; r unchanged when r <= 0, so a wrong answer's 0 stays 0 whatever it called.
- additive: r - c * k.
Worked numbers: r = 1, k = 2, c = 0.1 -> 0.81 multiplicative, 0.8 additive.

The correctness margin: under the reward in use a wrong episode gets at most `wrong_max` and a correct one
at least `correct_min` (the reward levels). A cost is accepted only when a correct episode with K calls
(K = env.max_turns, the most an episode can make) still outranks a wrong one with none; both forms are
monotone in r and in k, so that one comparison covers every pair of episodes.

Pure: numbers in, numbers (or a reason) out; the config's checks and the rollout call these.
"""

from collections.abc import Sequence
from enum import StrEnum


class CostForm(StrEnum):
    MULTIPLICATIVE = "multiplicative"  # r * (1 - c)**k for r > 0 (OTC)
    ADDITIVE = "additive"  # r - c * k


def cost_reward(reward: float, calls: int, cost: float, form: CostForm) -> float:
    """One episode's reward after the cost of its `calls` tool calls."""
    if form == CostForm.ADDITIVE:
        return reward - cost * calls
    return reward * (1.0 - cost) ** calls if reward > 0 else reward


def call_cost_reward(
    rewards: Sequence[float | None], calls: Sequence[int], cost: float, form: CostForm
) -> list[float | None]:
    """rewards [N] (None: unscorable, stays None) and calls [N] -> rewards after the cost [N]."""
    return [None if r is None else cost_reward(r, k, cost, form) for r, k in zip(rewards, calls, strict=True)]


def margin_problem(levels: tuple[float, float], cost: float, form: CostForm, max_calls: int) -> str | None:
    """Why `cost` could rank a wrong episode at or above a correct one, or None when it cannot.

    levels: (wrong_max, correct_min). The check is the applied formula itself at its worst case (a correct
    episode at correct_min with max_calls calls against a wrong one at wrong_max with none), so the
    accepted costs are exactly those for which the ranking holds in floating point too."""
    wrong_max, correct_min = levels
    if not correct_min > wrong_max:
        return (
            f"a correct episode's lowest reward {correct_min:g} does not exceed a wrong one's highest "
            f"{wrong_max:g}: no cost keeps correct answers ahead"
        )
    floor = cost_reward(correct_min, max_calls, cost, form)
    if floor > wrong_max:
        return None
    if form == CostForm.ADDITIVE:
        return (
            f"additive: cost x env.max_turns = {cost:g} x {max_calls} = {cost * max_calls:g} reaches the "
            f"correctness margin {correct_min - wrong_max:g} (correct_min {correct_min:g} - wrong_max "
            f"{wrong_max:g}); use a cost below {(correct_min - wrong_max) / max_calls:g}"
        )
    return (
        f"multiplicative: (1 - {cost:g})**{max_calls} x correct_min {correct_min:g} = {floor:g} does not "
        f"exceed wrong_max {wrong_max:g}"
    )


def derived_levels(
    terms: Sequence[tuple[float, bool, tuple[float, float] | None]],
) -> tuple[float, float] | None:
    """(wrong_max, correct_min) of a weighted sum of reward functions, from (weight, gold, range) terms.

    gold: a correctness check (1 correct, 0 wrong; partial credit is not modelled: set env.reward_levels
    then). Every other term takes its weighted range at its worst for the margin: its highest for a wrong
    episode, its lowest for a correct one. None: no gold term, or a term whose range is unknown."""
    if not any(gold for _, gold, _ in terms):
        return None
    wrong_max = correct_min = 0.0
    for weight, gold, bounds in terms:
        if gold:  # weight x 1 when correct, weight x 0 when wrong
            correct_min += weight
            continue
        if bounds is None:
            return None
        a, b = (weight * x for x in bounds)
        correct_min, wrong_max = correct_min + min(a, b), wrong_max + max(a, b)
    return wrong_max, correct_min
