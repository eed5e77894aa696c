"""Reward functions by name: the table each `RewardName` maps to (one signature for all), their ranges and kinds."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from grpo_run.rewards.code import CodeOutcome
from grpo_run.rewards.functions import format_reward, math_verifier, overlong_penalty, target_char_fraction
from grpo_run.rewards.names import RewardName
from grpo_run.sandbox.reward import code_exec


class RewardFn(Protocol):
    def __call__(
        self, prompts: Sequence[str], completions: Sequence[str], answers: Sequence[str], **kwargs: Any
    ) -> list[float | None]: ...


REWARD_FUNCTIONS: dict[RewardName, RewardFn] = {
    RewardName.MATH_VERIFIER: math_verifier,
    RewardName.FORMAT: format_reward,
    RewardName.OVERLONG_PENALTY: overlong_penalty,
    RewardName.TARGET_CHAR_FRACTION: target_char_fraction,
    RewardName.CODE_EXEC: code_exec,
}

# Each function's lowest and highest value for its kwargs, so that a zero-std group at the weighted total's
# bound counts as all correct / all wrong (train/frac_all_correct, frac_all_wrong).
REWARD_RANGES: dict[RewardName, Callable[[dict], tuple[float, float]]] = {
    RewardName.MATH_VERIFIER: lambda kwargs: (0.0, 1.0),
    RewardName.FORMAT: lambda kwargs: (0.0, 1.0),
    RewardName.OVERLONG_PENALTY: lambda kwargs: (-float(kwargs.get("penalty_factor", 1.0)), 0.0),
    RewardName.TARGET_CHAR_FRACTION: lambda kwargs: (0.0, 1.0),
    RewardName.CODE_EXEC: lambda kwargs: (0.0, 1.0),  # 1 passed; with fraction, a share of asserts
}


def reward_bounds(functions: Sequence[tuple[str, float, dict]]) -> tuple[float, float]:
    """The weighted total's lowest and highest possible values: functions as (name, weight, kwargs)."""
    lo = hi = 0.0
    for name, weight, kwargs in functions:
        a, b = (weight * x for x in REWARD_RANGES[RewardName(name)](kwargs))
        lo, hi = lo + min(a, b), hi + max(a, b)
    return lo, hi


# Functions that may hang or need a main thread (math-verify's signal.alarm): the scorer runs them in a
# worker process with a wall-clock budget. Everything else is cheap and runs in-process.
ISOLATED_REWARDS: frozenset[RewardName] = frozenset({RewardName.MATH_VERIFIER, RewardName.CODE_EXEC})

# Functions whose call failing in the pool (its budget, a dead worker) is an infrastructure failure: the
# completion is unscorable (None), not wrong (0).
UNSCORABLE_ON_FAILURE: frozenset[RewardName] = frozenset({RewardName.CODE_EXEC})

# Functions that label each value with an outcome (LabelledRewards): every kind, counted per step.
REWARD_KINDS: dict[str, tuple[str, ...]] = {
    RewardName.CODE_EXEC.value: tuple(kind.value for kind in CodeOutcome),
}


def get_reward_fn(name: str | RewardName) -> RewardFn:
    """The reward function called `name`; a ValueError lists the known names otherwise."""
    try:
        return REWARD_FUNCTIONS[RewardName(name)]
    except ValueError:
        known = ", ".join(member.value for member in RewardName)
        raise ValueError(f"unknown reward function {name!r}; known: {known}") from None
