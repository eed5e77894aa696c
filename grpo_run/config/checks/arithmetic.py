"""The arithmetic generator's knob rules (grpo_run.data.arithmetic), here so that the config checks of
`data.arithmetic` and its `mix` buckets apply the very rules the generator does."""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

OPERATIONS = ("+", "-", "*")

# A bucket's generator knobs; a bucket that leaves one out (or null) takes the top-level value.
BUCKET_KNOBS = ("num_operands", "min_digits", "max_digits", "operations", "word_problem_fraction")


class KnobError(ValueError):
    """A generator knob out of range; ``field`` names the knob, so a config check can name its full key."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class Knobs:
    num_operands: int
    min_digits: int
    max_digits: int
    operations: tuple[str, ...]
    word_problem_fraction: float
    allow_negative: bool


def default_knobs() -> dict:
    return {
        "num_operands": 2,
        "min_digits": 1,
        "max_digits": 2,
        "operations": ("+", "-"),
        "word_problem_fraction": 0.0,
        "allow_negative": False,
    }


def bucket_knobs(bucket: Mapping[str, Any], knobs: Mapping[str, Any]) -> dict:
    """A bucket's full knobs: the defaults, overridden by the top-level ``knobs``, then by the bucket's own
    (those it sets to something other than None)."""
    own = {k: bucket[k] for k in BUCKET_KNOBS if bucket.get(k) is not None}
    return {**default_knobs(), **knobs, **own}


def check_knobs(
    num_operands: int,
    min_digits: int,
    max_digits: int,
    operations: Sequence[str],
    word_problem_fraction: float,
    allow_negative: bool,
) -> Knobs:
    if num_operands < 2:
        raise KnobError("num_operands", f"num_operands must be >= 2, got {num_operands}")
    if not 1 <= min_digits <= max_digits:
        raise KnobError(
            "min_digits" if min_digits < 1 else "max_digits",
            f"need 1 <= min_digits <= max_digits, got min_digits={min_digits}, max_digits={max_digits}",
        )
    ops = tuple(operations)
    if not ops or any(op not in OPERATIONS for op in ops):
        raise KnobError("operations", f"operations must be a non-empty subset of {OPERATIONS}, got {ops}")
    if not 0.0 <= word_problem_fraction <= 1.0:
        raise KnobError(
            "word_problem_fraction", f"word_problem_fraction must be in [0, 1], got {word_problem_fraction}"
        )
    return Knobs(
        num_operands, min_digits, max_digits, ops, float(word_problem_fraction), bool(allow_negative)
    )
