"""Reward functions. Every one has the same signature:

    fn(prompts: list[str], completions: list[str], answers: list[str], **kwargs) -> list[float | None]

One value per completion, in order. None means "cannot be scored" (for example a gold answer that does not
parse); it is never the same as a wrong answer. Hyper-parameters are keyword arguments; per-completion data
(such as `completion_lengths`) also arrives as a keyword argument holding one entry per completion. Keywords a
function does not use are ignored, so the scorer can hand the same per-batch data to every function.

These functions do no I/O and no logging; `scoring.score` runs them safely (errors, timeouts, a process pool).

math-verify (and its LaTeX parsers) is imported on first use, not with this module: math_verifier runs in
the reward pool's workers, which import it at start (`scoring.RewardPool`'s `preload`), and the trainer's
process, which imports this module, never needs it (a few MB: sympy, the largest part, comes with
transformers anyway).
"""

from __future__ import annotations

import functools
import re
import threading
from collections.abc import Sequence
from typing import Any

from grpo_run.rewards.extract import boxed_contents, extract_answer, extract_gold, is_unevaluated_arithmetic


class LabelledRewards(list):
    """A reward function's values with one outcome label per value, for functions that tell outcomes apart.

    It is the list of values itself (so every caller that expects a list gets one); `labels[i]` names what
    completion i came to (code_exec: "passed", "timeout", ...) and `kinds` every label the function can
    give, so the scorer counts each kind, zeros included, as `train/rewards/<function>/<kind>`.
    """

    def __init__(self, values: Sequence[float | None], labels: Sequence[str], kinds: Sequence[str]) -> None:
        super().__init__(values)
        if len(labels) != len(values):
            raise ValueError(f"LabelledRewards got {len(labels)} labels for {len(values)} values")
        unknown = set(labels) - set(kinds)
        if unknown:
            raise ValueError(
                f"LabelledRewards labels {sorted(unknown)} are not among the kinds {list(kinds)}"
            )
        self.labels = list(labels)
        self.kinds = tuple(kinds)


class RewardTimeoutError(Exception):
    """A reward function gave up on one completion because it ran out of time.

    The scorer counts it as a timeout (reward 0 for that function), apart from errors and wrong answers.
    """


def math_verifier(
    prompts: Sequence[str],
    completions: Sequence[str],
    answers: Sequence[str],
    *,
    fallback_last_number: bool = True,
    verify_timeout_s: int = 5,
    **_: Any,
) -> list[float | None]:
    """1.0 if the completion's final answer equals the gold answer under math-verify, else 0.0.

    Only the extracted final answer is verified (`extract.extract_answer`), never the whole completion:
    math-verify evaluates bare expressions, so a completion that restates "43 + 5" would otherwise match 48;
    for the same reason a final answer that is itself undone arithmetic (`\\boxed{43 + 5}`) scores 0
    (`extract.is_unevaluated_arithmetic`).
    The gold goes through `extract.extract_gold` (GSM8K `#### 1,234` gives 1234). Both strings are parsed as
    LaTeX: wrapped in `$...$` unless they already carry math delimiters, so `\\frac{1}{2}`, `\\dfrac{3}{4}`,
    `0.5` and `1234` all parse. A gold that does not parse gives None (unscorable), never 1.0.

    `verify_timeout_s` bounds each math-verify parse and comparison (its own `signal.alarm`); running out
    raises `RewardTimeoutError`. signal.alarm needs the main thread, so this must run on the main thread of
    its process: the scorer runs it in a worker process (`scoring.RewardPool`), which also enforces a hard
    wall-clock budget around it.
    """
    if verify_timeout_s and threading.current_thread() is not threading.main_thread():
        raise RuntimeError(
            "math_verifier uses math-verify's signal.alarm timeouts and must run on a main thread; "
            "score it through grpo_run.scoring.pool.RewardPool (a worker process) instead of a thread"
        )
    rewards: list[float | None] = []
    for completion, answer in zip(completions, answers, strict=True):
        gold = _parse_gold(answer, verify_timeout_s)
        if gold is None:
            rewards.append(None)
            continue
        final = extract_answer(completion, fallback_last_number=fallback_last_number)
        if final is None or is_unevaluated_arithmetic(final):  # `\\boxed{43 + 5}` restates, not answers
            rewards.append(0.0)
            continue
        predicted = _parse_math(final, verify_timeout_s, keep_unparsed=True)
        rewards.append(1.0 if _equal(gold, predicted, verify_timeout_s) else 0.0)
    return rewards


def format_reward(
    prompts: Sequence[str], completions: Sequence[str], answers: Sequence[str], **_: Any
) -> list[float]:
    """1.0 if the completion holds a closed `\\boxed{...}` (or `\\fbox{...}`) with an answer in it, else 0.0.

    An empty box, or a box around undone arithmetic (`\\boxed{73 - 4}`, the question restated), is no answer:
    rewarding it taught SmolLM2 to box the question within a few steps, which also hid its correct answers
    from the math reward (the last box wins over the last-number fallback).
    """
    return [
        1.0 if any(c and not is_unevaluated_arithmetic(c) for c in boxed_contents(completion)) else 0.0
        for completion in completions
    ]


def overlong_penalty(
    prompts: Sequence[str],
    completions: Sequence[str],
    answers: Sequence[str],
    *,
    completion_lengths: Sequence[int],
    max_new_tokens: int,
    buffer_length: int,
    penalty_factor: float = 1.0,
    **_: Any,
) -> list[float]:
    """DAPO's soft overlong punishment, from each completion's length L in tokens.

    With the safe length S = max_new_tokens - buffer_length:
    0 when L <= S; -(L - S) / buffer_length * penalty_factor inside the buffer; -penalty_factor when
    L >= max_new_tokens. Example: max 100, buffer 20, factor 1: L = 80 gives 0, L = 90 gives -0.5, L = 100
    gives -1.
    """
    if not 0 < buffer_length <= max_new_tokens:
        raise ValueError(
            f"overlong_penalty needs 0 < buffer_length <= max_new_tokens, got buffer_length={buffer_length}, "
            f"max_new_tokens={max_new_tokens}"
        )
    if len(completion_lengths) != len(completions):
        raise ValueError(
            f"overlong_penalty got {len(completion_lengths)} completion_lengths for {len(completions)} completions"
        )
    safe_length = max_new_tokens - buffer_length
    penalties = []
    for length in completion_lengths:
        excess = min(max(length - safe_length, 0), buffer_length)
        penalties.append(-excess / buffer_length * penalty_factor)
    return penalties


def target_char_fraction(
    prompts: Sequence[str], completions: Sequence[str], answers: Sequence[str], *, target: str = "a", **_: Any
) -> list[float]:
    """Share of the completion's characters equal to `target` (0.0 for an empty completion).

    A dense, smooth reward a tiny random-init model with a byte-level tokenizer can learn from scratch:
    learning tests check that it rises under GRPO.
    """
    if len(target) != 1:
        raise ValueError(f"target_char_fraction needs a single character target, got {target!r}")
    return [completion.count(target) / len(completion) if completion else 0.0 for completion in completions]


def _as_math(text: str) -> str:
    """Put text into `$...$` unless it already has math delimiters (math-verify needs them for `\\dfrac`)."""
    # An escaped dollar (MATH's gold `\\$36`) is text, not a delimiter.
    if re.search(r"(?<!\\)\$", text) or "\\(" in text or "\\[" in text:
        return text
    return f"${text}$"


def _parse_math(text: str, timeout_s: int, *, keep_unparsed: bool) -> list[Any]:
    """math-verify's parse; parse errors give [], running out of time raises RewardTimeoutError."""
    from math_verify import parse
    from math_verify.errors import TimeoutException

    try:
        return parse(
            _as_math(text),
            fallback_mode="first_match" if keep_unparsed else "no_fallback",
            parsing_timeout=timeout_s or None,
            raise_on_error=True,
        )
    except TimeoutException as timeout:
        raise RewardTimeoutError(f"math-verify parse ran past {timeout_s} s") from timeout
    except Exception:
        return []


@functools.lru_cache(maxsize=4096)
def _parse_gold_cached(gold: str, timeout_s: int) -> tuple[Any, ...]:
    return tuple(_parse_math(gold, timeout_s, keep_unparsed=False))


def _parse_gold(answer: str, timeout_s: int) -> tuple[Any, ...] | None:
    """The parsed gold (cached: a group's G completions share one gold), or None if it does not parse."""
    parsed = _parse_gold_cached(extract_gold(answer), timeout_s)
    return parsed or None


def _equal(gold: Sequence[Any], predicted: Sequence[Any], timeout_s: int) -> bool:
    """True if any (gold, predicted) pair verifies, as math-verify's `verify` does, with timeouts surfaced."""
    from math_verify import verify
    from math_verify.errors import TimeoutException

    for gold_item in gold:
        for predicted_item in predicted:
            try:
                if verify(gold_item, predicted_item, timeout_seconds=timeout_s or None, raise_on_error=True):
                    return True
            except TimeoutException as timeout:
                raise RewardTimeoutError(f"math-verify comparison ran past {timeout_s} s") from timeout
            except Exception:
                continue
    return False
