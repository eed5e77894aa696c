"""Reward functions as a user writes them (TRL's form), importable by path for `_target_` tests."""

import asyncio
import math
import os
import time

CALLS: list[dict] = []  # what each call received, for in-process tests


def length_reward(completions, **kwargs):
    """TRL's documented form: completions first, everything else in **kwargs."""
    return [-abs(20 - len(completion)) / 20 for completion in completions]


def records_kwargs(prompts, completions, **kwargs):
    CALLS.append({"prompts": prompts, "completions": completions, **kwargs})
    return [1.0] * len(completions)


def matches_answer(prompts, completions, answer, **kwargs):
    """Reads the dataset's `answer` column by its own name."""
    return [1.0 if str(a) in c else 0.0 for c, a in zip(completions, answer, strict=True)]


def chat_contains_a(prompts, completions, **kwargs):
    """A conversational dataset: completions are [{"role": "assistant", "content": ...}] lists."""
    return [float("a" in completion[0]["content"]) for completion in completions]


def scaled(prompts, completions, scale=1.0, **kwargs):
    return [scale * completion.count("a") / max(len(completion), 1) for completion in completions]


def raises_on_b(prompts, completions, **kwargs):
    if any("b" in c for c in completions):
        raise ValueError("no b please")
    return [1.0] * len(completions)


def nan_reward(prompts, completions, **kwargs):
    return [math.nan] * len(completions)


def one_value(prompts, completions, **kwargs):
    return [1.0]


def worker_pid(prompts, completions, **kwargs):
    return [float(os.getpid())] * len(completions)


def hangs_on_hang(prompts, completions, **kwargs):
    if completions[0] == "hang":
        time.sleep(60)
    return [1.0]


def none_for_empty(prompts, completions, **kwargs):
    return [None if not c else 1.0 for c in completions]


# Two async rewards that only finish together: each sets its own event and waits for the other's, so a
# scorer that awaited them one after the other would time out (and count errors) instead.
_EVENTS: dict[str, asyncio.Event] = {}


async def _handshake(mine: str, other: str, n: int) -> list[float]:
    _EVENTS.setdefault(mine, asyncio.Event()).set()
    await asyncio.wait_for(_EVENTS.setdefault(other, asyncio.Event()).wait(), timeout=5)
    return [1.0] * n


async def async_left(prompts, completions, **kwargs):
    return await _handshake("left", "right", len(completions))


async def async_right(prompts, completions, **kwargs):
    return await _handshake("right", "left", len(completions))


def reset_events() -> None:
    _EVENTS.clear()


class CountsA:
    """Class-based: built once with the entry's kwargs, then called per batch."""

    built = 0

    def __init__(self, letter: str = "a", bonus: float = 0.0):
        type(self).built += 1
        self.letter, self.bonus = letter, bonus

    def __call__(self, prompts, completions, **kwargs):
        return [c.count(self.letter) / max(len(c), 1) + self.bonus for c in completions]


def no_kwargs(prompts, completions):
    return [1.0] * len(completions)


NOT_CALLABLE = 3


def level_reward(completions, level, **kwargs):
    """Reads the dataset's own `level` column."""
    return [float(x) for x in level]


def ids_agree(prompts, completions, completion_ids, completion_lengths, step, **kwargs):
    """1 where the token ids are the completion's own (as many as its length) and the step is a step."""
    assert isinstance(step, int) and step >= 1
    return [float(len(ids) == n) for ids, n in zip(completion_ids, completion_lengths, strict=True)]


def plus_only(prompts, completions, **kwargs):
    """A multi-task half: the share of "a" on "+" problems, None (not applicable) on the others."""
    return [c.count("a") / max(len(c), 1) if "+" in p else None for p, c in zip(prompts, completions)]


def not_plus(prompts, completions, **kwargs):
    """The other half: the share of "a" where plus_only says None, None on "+" problems."""
    return [None if "+" in p else c.count("a") / max(len(c), 1) for p, c in zip(prompts, completions)]


def always_raises(prompts, completions, **kwargs):
    raise RuntimeError("this reward is broken")


def needs_solution(completions, solution, **kwargs):
    """Reads a `solution` column, which arithmetic data does not have."""
    return [float(s in c) for s, c in zip(solution, completions)]


def singular_completion(completion, **kwargs):
    """`completion`: a parameter neither the call nor a column fills (the call passes `completions`)."""
    return [1.0] * len(completion)


def make_scaled(scale):
    """A factory (TRL's `get_soft_overlong_punishment` style): returns the reward function."""

    def scaled_len(completions, **kwargs):
        return [scale * len(c) for c in completions]

    return scaled_len
