"""What a batch's scoring came to: the weighted terms (`RewardSpec`), `ScoreResult`, and the tally that
turns every function's call outcomes into values, counts, labels and the weighted totals (the rules are
`dispatch`'s docstring).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from grpo_run.rewards.functions import LabelledRewards
from grpo_run.scoring.pool import CallOutcome
from grpo_run.scoring.registry import RewardEntry

FAILURE_LABEL = "sandbox_failure"


@dataclass(frozen=True)
class RewardSpec:
    """One reward function of the total: its name (metric keys), weight in the sum, keyword
    hyper-parameters, and its registry entry (None: the built-in called `name`)."""

    name: str
    weight: float = 1.0
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    entry: RewardEntry | None = None

    def __post_init__(self) -> None:
        # A RewardName member becomes its plain string, so names compare and hash like the YAML value.
        object.__setattr__(self, "name", getattr(self.name, "value", self.name))


@dataclass
class ScoreResult:
    """Rewards of one batch.

    total: weighted sum per completion over the functions that gave it a value; None when every function
        said None for it, or an `unscorable_on_failure` entry's call failed on it.
    per_function: each function's values by spec name (errors and timeouts appear as 0.0, None stays).
    errors / timeouts: counts of (function, completion) cells that raised / ran out of time.
    unscorable: number of completions whose total is None.
    unrewarded: completions that no function scored (every one raised, timed out or said None).
    first_error: the traceback text of the first error, or None.
    labels: "<function>/<kind>" -> count, for functions that label their values (LabelledRewards).
    restarts: reward workers found dead (a signal, the OOM killer) and replaced during this call; their
        completions were scored again by the new workers.
    """

    total: list[float | None]
    per_function: dict[str, list[float | None]]
    errors: int = 0
    timeouts: int = 0
    unscorable: int = 0
    first_error: str | None = None
    labels: dict[str, int] = field(default_factory=dict)
    restarts: int = 0
    errors_by_function: dict[str, int] = field(default_factory=dict)
    timeouts_by_function: dict[str, int] = field(default_factory=dict)
    unrewarded: int = 0


def sum_by_weight(
    resolved: Sequence[tuple[RewardSpec, RewardEntry]],
    outcomes: Mapping[str, list[CallOutcome]],
    result: ScoreResult,
) -> None:
    """Fills `result` from every function's outcomes (in the specs' order): its values and counts, then
    the weighted totals over the functions that gave a value (TRL's nansum; None where none did, or where
    an infrastructure failure left the completion without a verdict) and how many are None."""
    n = len(result.total)
    voided: set[int] = set()  # completions an unscorable_on_failure entry could not judge
    scored = [False] * n  # a function gave the completion a value, not an error, timeout or None
    for spec, entry in resolved:
        calls = outcomes[spec.name]
        values = result.per_function[spec.name] = _tally(spec.name, entry, calls, result)
        _count_labels(spec.name, entry, calls, result)
        for i, (value, call) in enumerate(zip(values, calls, strict=True)):
            failed = call.timed_out or call.error is not None or _value_error(call) is not None
            scored[i] = scored[i] or (value is not None and not failed)
            if failed and value is None:
                voided.add(i)
    for i in range(n):
        given = [(spec.weight, result.per_function[spec.name][i]) for spec, _ in resolved]
        present = [weight * value for weight, value in given if value is not None]
        result.total[i] = None if i in voided or not present else sum(present, 0.0)
    result.unscorable = sum(total is None for total in result.total)
    result.unrewarded = scored.count(False)


def _tally(
    name: str, entry: RewardEntry, outcomes: Sequence[CallOutcome], result: ScoreResult
) -> list[float | None]:
    """One value per completion from the outcomes (each holding a 1-element list); counts into `result`."""
    values: list[float | None] = []
    failed = None if entry.unscorable_on_failure else 0.0
    errors = timeouts = 0
    for i, outcome in enumerate(outcomes):
        error = outcome.error
        value: float | None = 0.0
        if outcome.timed_out:
            timeouts += 1
            error = None
            value = failed
        elif error is None:
            error = length_error(name, outcome.value, 1)
            if error is None:
                value, error = _as_reward(outcome.value[0])
        if error is not None:
            errors += 1
            # a value that came back wrong is the function's fault: 0; a call that failed may be the sandbox's
            value = 0.0 if outcome.error is None or outcome.bad_value else failed
            if result.first_error is None:
                result.first_error = f"reward function {name!r} failed on completion {i}:\n{error}"
        values.append(value)
    result.errors += errors
    result.timeouts += timeouts
    result.errors_by_function[name] = errors
    result.timeouts_by_function[name] = timeouts
    return values


def _count_labels(
    name: str, entry: RewardEntry, outcomes: Sequence[CallOutcome], result: ScoreResult
) -> None:
    """Count the labels of a labelling function's values, every kind of it (entry or values) present."""
    kinds = list(entry.kinds)
    labels = []
    for outcome in outcomes:
        if isinstance(outcome.value, LabelledRewards):
            kinds += [k for k in outcome.value.kinds if k not in kinds]
            labels += outcome.value.labels
        elif outcome.error is not None and entry.unscorable_on_failure:
            labels.append(FAILURE_LABEL)
    if not kinds:
        return
    if FAILURE_LABEL in labels and FAILURE_LABEL not in kinds:
        kinds.append(FAILURE_LABEL)
    for kind in kinds:
        result.labels[f"{name}/{kind}"] = labels.count(kind)


def _value_error(outcome: CallOutcome) -> str | None:
    """Why a call that returned gave no usable value (a wrong length, not a number), or None."""
    if outcome.error is not None or outcome.timed_out:
        return None
    return length_error("", outcome.value, 1) or _as_reward(outcome.value[0])[1]


def _as_reward(value: Any) -> tuple[float | None, str | None]:
    """(reward, None); (None, None) for None or NaN (not applicable, TRL's nansum); or (0.0, why) when the
    value is not a number, or infinite."""
    if value is None:
        return None, None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return 0.0, f"returned {value!r}, not a number"
    if math.isnan(number):
        return None, None
    if not math.isfinite(number):
        return 0.0, f"returned {number}, not a finite number"
    return number, None


def length_error(name: str, values: Any, expected: int) -> str | None:
    if isinstance(values, Sequence) and not isinstance(values, str) and len(values) == expected:
        return None
    got = f"{len(values)} values" if isinstance(values, Sequence) else f"a {type(values).__name__}"
    return f"reward function {name!r} returned {got} for {expected} completions"
