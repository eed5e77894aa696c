"""A user's reward function named by import path (`reward.functions[i]._target_`), called as TRL calls it.

    fn(prompts=[...], completions=[...], **kwargs) -> list[float | None]

`kwargs` holds every column of each completion's example under its own name (one value per completion),
`completion_ids` (each completion's token ids), `trainer_state` (TRL's fields a reward reads: `global_step`,
`max_steps`, `epoch`, `num_train_epochs`) and `step` (the training step, 0 in evaluation). Prompts of a
conversational dataset are message lists and completions `[{"role": "assistant", "content": ...}]`, as in
TRL; otherwise both are strings. The result holds one value per completion (a list or tuple of numbers,
bools or None, a numpy array or a torch tensor); `None` (or NaN) means "not applicable to this completion":
the other functions' weighted values make its reward, as TRL's `nansum` does.

The target is a function (plain or `async def`) called with the entry's `kwargs` added to every call, a
class instantiated once per process with the entry's `kwargs` and then called per batch, or a factory (a
function that takes the kwargs but not the reward call, as TRL's `get_soft_overlong_punishment`) called
once per process with them, what it returns called per batch. `UserReward`
holds only the import path and the kwargs, so it pickles by value into the reward pool's workers, which
import the target there (the reason `_target_` must import by path, not be a lambda or a local).
"""

from __future__ import annotations

import asyncio
import difflib
import inspect
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# Keywords the call itself passes (TRL's, then grpo-run's step and token counts); a dataset column of one of
# these names cannot reach the function.
CALL_KEYWORDS = ("prompts", "completions", "completion_ids", "trainer_state", "step", "completion_lengths")


@dataclass(frozen=True)
class RewardTrainerState:
    """What TRL's `trainer_state` (transformers' TrainerState) gives a reward that shapes itself by the
    run's progress, with the same field names; picklable, so it reaches the reward pool's workers.

    global_step: optimizer steps done, as TRL's (0 while the first step's completions are scored; in an
    evaluation, the steps the evaluated weights had); epoch: training prompts drawn in those steps over the
    training split's size (fractional, as TRL's); num_train_epochs: the epochs the run's max_steps cover
    (rounded up, as transformers does when max_steps is set)."""

    global_step: int = 0
    max_steps: int = 0
    epoch: float = 0.0
    num_train_epochs: int = 0

    @classmethod
    def of_run(
        cls, global_step: int, max_steps: int, prompts_per_step: int, train_size: int
    ) -> RewardTrainerState:
        """The state after `global_step` optimizer steps of a run of `max_steps` steps drawing
        `prompts_per_step` prompts a step from a training split of `train_size` examples."""
        per_epoch = max(train_size, 1)
        return cls(
            global_step=global_step,
            max_steps=max_steps,
            epoch=global_step * prompts_per_step / per_epoch,
            num_train_epochs=-(-max_steps * prompts_per_step // per_epoch),
        )


# One instance per (target, kwargs) per process: a class target is built once, not per batch or call.
_INSTANCES: dict[tuple[str, str], Callable[..., Any]] = {}


class UserRewardError(ValueError):
    """A `_target_` that does not import, is not callable, or cannot take TRL's reward call."""


def import_target(path: str) -> Any:
    """The object a dotted path names (`pkg.module.fn` or `pkg.module.Class`)."""
    from hydra.utils import get_object

    try:
        return get_object(path)
    except Exception as err:  # an import error, a missing attribute: the user's path is wrong
        raise UserRewardError(f"cannot be imported ({type(err).__name__}: {err})") from None


def _takes_call(params: list[inspect.Parameter]) -> bool:
    """Whether a callable with `params` can take TRL's reward call: `**kwargs`, nothing positional-only."""
    takes_kwargs = any(p.kind is p.VAR_KEYWORD for p in params)
    return takes_kwargs and not any(p.kind is p.POSITIONAL_ONLY for p in params)


def is_factory(target: Any, kwargs: Mapping[str, Any]) -> bool:
    """A function that cannot take the reward call but takes the entry's kwargs makes the reward function
    (TRL's `get_soft_overlong_punishment(max_completion_len, soft_punish_cache)`): it is called once with
    them, as a class is built once, and what it returns is called per batch."""
    if inspect.isclass(target) or not callable(target):
        return False
    signature = inspect.signature(target)
    if _takes_call(list(signature.parameters.values())):
        return False
    try:
        signature.bind(**kwargs)
    except TypeError:
        return False
    return True


def _built(target: Any, kwargs: Mapping[str, Any]) -> bool:
    """Whether the reward is an object built once from `target` with the kwargs (a class or a factory)."""
    return inspect.isclass(target) or is_factory(target, kwargs)


def call_parameters(target: Any, kwargs: Mapping[str, Any]) -> list[inspect.Parameter]:
    """The parameters TRL's reward call fills: a function's, a class's `__call__`'s (without self), or
    those of what a factory returns (built here, once)."""
    if inspect.isclass(target):
        call = target.__call__ if "__call__" in dir(target) else None
        if call is None or call is object.__call__:
            raise UserRewardError("the class has no __call__(self, prompts, completions, **kwargs)")
        return list(inspect.signature(call).parameters.values())[1:]
    if is_factory(target, kwargs):
        try:
            made = target(**kwargs)
        except Exception as err:
            raise UserRewardError(
                f"raised when called with its kwargs ({type(err).__name__}: {err})"
            ) from None
        if not callable(made):
            raise UserRewardError(f"returned a {type(made).__name__}, not a reward function")
        return list(inspect.signature(made).parameters.values())
    return list(inspect.signature(target).parameters.values())


def check_callable(target: Any, kwargs: Mapping[str, Any]) -> None:
    """Raise UserRewardError unless `target` (an instance of it built with `kwargs`, or what it returns
    when it is a factory) can be called as `fn(prompts=..., completions=..., **columns)`: it takes
    `**kwargs` and no positional-only parameter. Other named parameters are columns (TRL's
    `def accuracy(completions, solution, **kwargs)`)."""
    if not callable(target):
        raise UserRewardError(f"is not a function or a class (got {type(target).__name__})")
    if inspect.isclass(target):
        try:
            inspect.signature(target).bind(**kwargs)
        except TypeError as err:
            raise UserRewardError(f"the class does not take its kwargs {sorted(kwargs)}: {err}") from None
    params = call_parameters(target, kwargs)
    if not _takes_call(params):
        raise UserRewardError(
            "must take (prompts, completions, **kwargs) by keyword: TRL's reward call passes every dataset "
            f"column as a keyword; its parameters are ({', '.join(str(p) for p in params)}) (a function "
            "that makes the reward function from its kwargs is called once with them)"
        )


def unfilled_parameters(target: Any, kwargs: Mapping[str, Any], columns: Collection[str]) -> list[str]:
    """The named parameters without a default that neither the call (CALL_KEYWORDS), the entry's
    `kwargs` (a function's) nor a column of the data fill: each would fail on every call."""
    given = set(CALL_KEYWORDS) | set(columns) | (set() if _built(target, kwargs) else set(kwargs))
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [
        p.name
        for p in call_parameters(target, kwargs)
        if p.kind in named and p.default is inspect.Parameter.empty and p.name not in given
    ]


def describe_unfilled(name: str, columns: Collection[str]) -> str:
    """Why a parameter gets no value, and the likely one it meant."""
    close = difflib.get_close_matches(name, [*CALL_KEYWORDS, *columns], n=1, cutoff=0.6)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return (
        f"its parameter {name!r} is neither a column of the data nor an argument of the reward call{hint}; "
        f"columns: {', '.join(sorted(columns)) or 'none'}; the call passes {', '.join(CALL_KEYWORDS)}"
    )


class UserReward:
    """The picklable callable the scorer runs for a user entry; adapts TRL's call to the scorer's.

    The scorer calls `reward(prompts, completions, answers, **batch)` (its internal convention); `batch`
    already holds the columns, `completion_ids` and `step`, and `answers` (the parsed gold) is not passed on:
    a user's function reads the column it needs.
    """

    def __init__(self, target: str, kwargs: Mapping[str, Any] | None = None) -> None:
        self.target = target
        self.kwargs = dict(kwargs or {})

    def __repr__(self) -> str:
        return f"UserReward({self.target!r})"

    @property
    def module(self) -> str:
        """The module the reward pool imports in its workers before the budget clock starts."""
        return self.target.rpartition(".")[0]

    def resolve(self) -> tuple[Callable[..., Any], dict[str, Any]]:
        """(callable, keywords added to every call): a function and the entry's kwargs, or the class's
        instance (built once per process with the kwargs) and no extra keywords."""
        target = import_target(self.target)
        if not _built(target, self.kwargs):
            return target, self.kwargs
        key = (self.target, repr(sorted(self.kwargs.items())))
        if key not in _INSTANCES:
            _INSTANCES[key] = target(**self.kwargs)
        return _INSTANCES[key], {}

    @property
    def is_async(self) -> bool:
        fn, _ = self.resolve()
        # a class's instance is async when its __call__ is
        call = fn if inspect.isfunction(fn) or inspect.ismethod(fn) else type(fn).__call__
        return inspect.iscoroutinefunction(call)

    def arguments(
        self, prompts: Sequence[Any], completions: Sequence[str], batch: Mapping[str, Any]
    ) -> dict[str, Any]:
        """TRL's keywords for one call: chat prompts turn completions into assistant messages."""
        fn_kwargs = self.resolve()[1]
        clash = sorted(set(fn_kwargs) & (set(batch) | {"prompts", "completions"}))
        if clash:
            raise TypeError(f"the entry's kwargs {clash} clash with the reward call's keywords or columns")
        chat = bool(prompts) and isinstance(prompts[0], (list, tuple))
        texts = [[{"role": "assistant", "content": c}] for c in completions] if chat else list(completions)
        return {"prompts": list(prompts), "completions": texts, **batch, **fn_kwargs}

    def __call__(
        self, prompts: Sequence[Any], completions: Sequence[str], answers: Sequence[str], **batch: Any
    ) -> list[float | None]:
        fn, _ = self.resolve()
        result = fn(**self.arguments(prompts, completions, batch))
        if inspect.isawaitable(result):
            result = asyncio.run(_awaited(result))
        return result

    async def acall(
        self, prompts: Sequence[Any], completions: Sequence[str], answers: Sequence[str], **batch: Any
    ) -> list[float | None]:
        """The async function's coroutine, so the scorer can run a step's async rewards concurrently."""
        fn, _ = self.resolve()
        return await fn(**self.arguments(prompts, completions, batch))


async def _awaited(awaitable: Any) -> Any:
    return await awaitable
