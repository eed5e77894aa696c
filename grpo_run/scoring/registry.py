"""Every reward the scorer can call, one record each: its function, range, outcome kinds and isolation.

A built-in reward is an entry of `BUILTIN_REWARDS` under the name a config writes (`name: math_verifier`);
a user's reward is an entry made from `_target_: package.module.function`, a reward model or judge one
made from `model: {path: ...}` (`grpo_run.scoring.model_reward`). The scorer
(`grpo_run.scoring.dispatch`) and the run (`run_scorer`) only ever read entries, so a new built-in touches this
table and its function, nothing else.

Two call conventions, both in `grpo_run.rewards`' terms "one value per completion, None = unscorable":
- built-ins: ``fn(prompts, completions, answers, **kwargs)`` with the parsed gold answers;
- user functions: TRL's ``fn(prompts=..., completions=..., **kwargs)`` with the examples' columns, the
  completion token ids and the step as keywords (`grpo_run.scoring.user`), so a function written for TRL's
  GRPOTrainer runs unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from grpo_run.rewards.code import CodeOutcome
from grpo_run.rewards.functions import format_reward, math_verifier, overlong_penalty, target_char_fraction
from grpo_run.rewards.names import RewardName
from grpo_run.rewards.reasoning_gym import reasoning_gym_score
from grpo_run.sandbox.reward import code_exec


class RewardFn(Protocol):
    def __call__(
        self, prompts: Sequence[str], completions: Sequence[str], answers: Sequence[str], **kwargs: Any
    ) -> list[float | None]: ...


Range = Callable[[Mapping[str, Any]], tuple[float, float]]


def unit_range(kwargs: Mapping[str, Any]) -> tuple[float, float]:
    return 0.0, 1.0


def _overlong_range(kwargs: Mapping[str, Any]) -> tuple[float, float]:
    return -float(kwargs.get("penalty_factor", 1.0)), 0.0


@dataclass(frozen=True)
class RewardEntry:
    """One reward function and what the scorer must know to call it.

    fn: the callable, picklable when isolated (a top-level function, or `scoring.user.UserReward`).
    range: its (lowest, highest) value for the entry's kwargs, so a zero-std group at the weighted total's
        bound counts as all correct / all wrong (train/frac_all_correct, frac_all_wrong); None: unknown,
        and those two fractions are not computed for the run.
    isolated: runs in the reward pool, one completion per call under `reward.timeout_s` (functions that may
        hang, or need a main thread: math-verify's signal.alarm); else in-process on the whole batch.
    unscorable_on_failure: a failure of the call itself (an error, the pool's budget, a dead worker) is an
        infrastructure failure: the completion is unscorable (None), not 0, and a labelling entry's label
        for it is "sandbox_failure" (code_exec's sandbox; a reward model or judge).
    kinds: the outcome labels its values carry (`LabelledRewards`), each counted per step, zeros included.
    columns: receives the examples' columns, `completion_ids` and `step` as keywords (a user's function:
        through `UserReward`, in TRL's convention; reasoning_gym: the record's `metadata`).
    preload: modules an isolated entry's pool workers import before its first call (off the budget clock).
    batch: completions per pool call of an isolated entry; 1: one each, the budget per completion; more
        (a model): up to that many in one call under the budget, and a call that raises is tried again
        one completion at a time to find the bad ones.
    prepare: what an isolated entry's worker runs once before its first call, off the budget clock and
        again after a hang killed it (a model entry loads its model); picklable (a top-level function, a
        bound method of a picklable object).
    own_worker: runs in a pool of its own, one worker process (a model: it stays loaded there, its hang
        kills no other reward's worker, and other rewards' hangs do not unload it).
    """

    fn: RewardFn
    range: Range | None = unit_range
    isolated: bool = False
    unscorable_on_failure: bool = False
    kinds: tuple[str, ...] = ()
    columns: bool = False
    preload: tuple[str, ...] = ()
    batch: int = 1
    prepare: Callable[[], None] | None = None
    own_worker: bool = False


BUILTIN_REWARDS: dict[str, RewardEntry] = {
    # final answer equals the gold under math-verify (its signal.alarm needs a main thread: the pool)
    RewardName.MATH_VERIFIER.value: RewardEntry(math_verifier, isolated=True),
    RewardName.FORMAT.value: RewardEntry(format_reward),
    RewardName.OVERLONG_PENALTY.value: RewardEntry(overlong_penalty, range=_overlong_range),
    RewardName.TARGET_CHAR_FRACTION.value: RewardEntry(target_char_fraction),
    # 1 passed; with fraction, a share of asserts; a sandbox that fails is unscorable, never 0
    RewardName.CODE_EXEC.value: RewardEntry(
        code_exec,
        isolated=True,
        unscorable_on_failure=True,
        kinds=tuple(kind.value for kind in CodeOutcome),
    ),
    # each task's own checker (reasoning-gym, an optional extra), from the record's metadata column
    RewardName.REASONING_GYM.value: RewardEntry(
        reasoning_gym_score, isolated=True, columns=True, preload=("reasoning_gym",)
    ),
}


def builtin_entry(name: str | RewardName) -> RewardEntry:
    """The built-in reward called `name`; a ValueError lists the known names otherwise."""
    name = getattr(name, "value", name)
    try:
        return BUILTIN_REWARDS[name]
    except KeyError:
        known = ", ".join(BUILTIN_REWARDS)
        raise ValueError(f"unknown reward function {name!r}; known: {known}") from None


def get_reward_fn(name: str | RewardName) -> RewardFn:
    """The built-in function called `name` (scripts that call one directly)."""
    return builtin_entry(name).fn


def weighted_bounds(terms: Sequence[tuple[float, tuple[float, float] | None]]) -> tuple[float, float] | None:
    """The weighted total's lowest and highest possible values from (weight, (lo, hi)) terms; None when
    any term's range is unknown."""
    lo = hi = 0.0
    for weight, bounds in terms:
        if bounds is None:
            return None
        a, b = (weight * x for x in bounds)
        lo, hi = lo + min(a, b), hi + max(a, b)
    return lo, hi
