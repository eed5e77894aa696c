"""The call dispatcher the trainer uses: run every reward function on a batch and combine them.

`score` never lets one bad completion or one bad function sink a step, and never hides a failure in a
silent 0:
- A function that raises: it is called again one completion at a time to find the bad completions; each of
  those gets 0 for that function and counts in `errors`; the first traceback is kept in `first_error` so the
  caller can log it once.
- A value that is neither None, NaN nor a finite number, and a result of the wrong length (every completion
  of that call), count in `errors` the same way and score 0. A result is a list or tuple of numbers, bools
  or None, a numpy array or a torch tensor (TRL's reward functions return each).
- A completion that runs out of time (past `timeout_s` in the pool, or a function raising
  `RewardTimeoutError`) gets 0 for that function and counts in `timeouts`, apart from errors.
- None (or NaN) from a function means "not applicable to this completion" (TRL's convention: a math reward
  says None on a code row of a multi-task run): the total is the weighted sum of the other functions' values
  (TRL's `nansum`). A completion for which every function said None has no total (None) and counts in
  `unscorable`; the caller leaves it out of its group's statistics with advantage 0, as TRL 1.16 does.
- A function that labels its values (`LabelledRewards`, e.g. code_exec's "passed", "timeout", ...) has its
  labels counted per kind in `labels` ("code_exec/passed" -> n), every kind of it present, zeros included.
- For an entry with `unscorable_on_failure` (code_exec, a reward model or judge), an error or timeout of the
  call itself (the pool's budget, a dead worker) is an infrastructure failure: that completion gets None
  (unscorable), is still counted in `errors` / `timeouts`, and a labelling entry labels it
  "sandbox_failure". Such a failure leaves the whole completion unscorable, whatever the other functions
  said: a missing verdict is not "not applicable", and the rest alone would score it as if it were.
- `unrewarded` counts the completions no function scored at all (each raised, timed out or said None): a
  step where that is every completion trained on nothing.
Per function, `errors_by_function` / `timeouts_by_function` hold the same counts.

Isolated entries (math-verify and its `signal.alarm`, the sandbox, a user's `isolated: true`) run in a
`RewardPool` of worker processes, one completion per task, each under the wall-clock budget `timeout_s`.
A model entry (`RewardEntry.batch` > 1, `own_worker`) runs in a pool of its own, up to `batch` completions
per task under the same budget; a task that raises is run again one completion per task.
The others run in-process on the whole batch and have no budget; a step's `async def` user functions
run concurrently there.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from grpo_run.rewards.functions import LabelledRewards
from grpo_run.scoring.pool import CallOutcome, RewardPool, as_values, guarded_call
from grpo_run.scoring.registry import BUILTIN_REWARDS, RewardEntry, RewardFn, builtin_entry
from grpo_run.scoring.tally import RewardSpec, ScoreResult, length_error, sum_by_weight
from grpo_run.scoring.user import RewardTrainerState, UserReward


@dataclass(frozen=True)
class UserInputs:
    """What a user's (TRL-style) reward receives beyond the text: the prompts as the dataset gave them
    (strings, or message lists for a conversational dataset), every column of each completion's example
    (one value per completion, `completion_ids` among them), the step and TRL's `trainer_state` (None:
    one that knows only the step)."""

    prompts: Sequence[Any]
    columns: Mapping[str, Sequence[Any]] = field(default_factory=dict)
    step: int = 0
    trainer_state: RewardTrainerState | None = None


def score(
    specs: Sequence[RewardSpec],
    prompts: Sequence[str],
    completions: Sequence[str],
    answers: Sequence[str],
    *,
    timeout_s: float,
    pool: RewardPool | None = None,
    batch_kwargs: Mapping[str, Sequence[Any]] | None = None,
    user_inputs: UserInputs | None = None,
    functions: Mapping[str, RewardFn] | None = None,
    isolated: Collection[str] | None = None,
    pools: Mapping[str, RewardPool] | None = None,
) -> ScoreResult:
    """Score one batch with every spec and sum them by weight (see the module docstring for the rules).

    timeout_s: wall-clock budget per completion for the functions that run in the pool.
    pool: reused across calls when given; otherwise one is started for this call only (if needed) and closed.
    batch_kwargs: per-completion data passed to every function as keywords, one entry per completion, as
        plain Python lists (e.g. {"completion_lengths": [...]} for overlong_penalty; not tensors, which would
        make each pool worker import torch); sliced to [value] when a function is called per completion.
    user_inputs: what user entries (TRL's call) receive besides: their prompts, the columns and the step;
        default: the prompts as given, no columns, step 0.
    functions: name -> function, looked up before the registry (lets tests and callers add functions); one
        standing in for a built-in's name keeps that built-in's record (isolation, kinds, range).
    isolated: which of the other `functions` run in the pool (default: none of them).
    pools: spec name -> the pool of an `own_worker` entry, reused across calls; one missing is started for
        this call only and closed.
    """
    n = len(completions)
    batch_kwargs = dict(batch_kwargs or {})
    user_inputs = user_inputs or UserInputs(prompts=prompts)
    _check_inputs(specs, prompts, completions, answers, batch_kwargs, user_inputs, timeout_s)
    resolved = [(spec, _entry(spec, functions or {}, set(isolated or ()))) for spec in specs]

    result = ScoreResult(total=[0.0] * n, per_function={})
    own_pool = None
    started: list[RewardPool] = []  # own_worker pools started for this call only
    try:
        outcomes = _run_concurrently(resolved, prompts, completions, answers, batch_kwargs, user_inputs)
        for spec, entry in resolved:
            if spec.name in outcomes:
                continue
            args = _arguments(spec, entry, prompts, completions, answers, batch_kwargs, user_inputs)
            if entry.isolated and entry.own_worker:
                target = _own_worker_pool(spec.name, entry, pools or {}, started)
                outcomes[spec.name] = _pool_outcomes(spec.name, entry, target, args, timeout_s, result)
            elif entry.isolated:
                if pool is None:
                    pool = own_pool = RewardPool()
                outcomes[spec.name] = _pool_outcomes(spec.name, entry, pool, args, timeout_s, result)
            else:
                outcomes[spec.name] = _run_in_process(spec.name, entry.fn, *args)
    finally:
        for started_pool in [*started, *([own_pool] if own_pool is not None else [])]:
            started_pool.close()

    sum_by_weight(resolved, outcomes, result)
    return result


# A worker of its own loads a model before its first call: that may take longer than importing modules.
MODEL_START_TIMEOUT_S = 600.0


def entry_pool(entry: RewardEntry) -> RewardPool:
    """The pool of an `own_worker` entry: one worker process, which imports only what the entry needs."""
    return RewardPool(max_workers=1, preload=entry.preload, start_timeout_s=MODEL_START_TIMEOUT_S)


def _own_worker_pool(
    name: str, entry: RewardEntry, pools: Mapping[str, RewardPool], started: list[RewardPool]
) -> RewardPool:
    """The caller's pool for an `own_worker` entry, or one started for this call (added to `started`)."""
    target = pools.get(name)
    if target is None:
        target = entry_pool(entry)
        started.append(target)
    return target


def _pool_outcomes(
    name: str,
    entry: RewardEntry,
    pool: RewardPool,
    args: tuple[Any, ...],
    timeout_s: float,
    result: ScoreResult,
) -> list[CallOutcome]:
    """`_run_in_pool` with `args` (from `_arguments`); the workers replaced meanwhile are added to
    `result.restarts` even when the call raises."""
    before = pool.restarts
    try:
        return _run_in_pool(name, entry, pool, args, timeout_s)
    finally:
        result.restarts += pool.restarts - before


def _entry(spec: RewardSpec, functions: Mapping[str, RewardFn], isolated: Collection[str]) -> RewardEntry:
    if spec.entry is not None:
        return spec.entry
    if spec.name in BUILTIN_REWARDS and spec.name in functions:  # a stand-in keeps the built-in's record
        return dataclasses.replace(BUILTIN_REWARDS[spec.name], fn=functions[spec.name])
    if spec.name in functions:
        return RewardEntry(functions[spec.name], range=None, isolated=spec.name in isolated)
    return builtin_entry(spec.name)


def _is_async(fn: RewardFn) -> bool:
    return isinstance(fn, UserReward) and fn.is_async


def _arguments(
    spec: RewardSpec,
    entry: RewardEntry,
    prompts: Sequence[str],
    completions: Sequence[str],
    answers: Sequence[str],
    batch_kwargs: Mapping[str, Sequence[Any]],
    user_inputs: UserInputs,
) -> tuple[Any, ...]:
    """(prompts, completions, answers, kwargs, per-completion kwargs) for one entry: a user's function gets
    the dataset's prompts, every column and the step (kept whole when the call is split per completion)."""
    if not entry.columns:
        return prompts, completions, answers, spec.kwargs, batch_kwargs
    columns = {**batch_kwargs, **user_inputs.columns}
    state = user_inputs.trainer_state or RewardTrainerState(global_step=user_inputs.step)
    kwargs = {**spec.kwargs, "step": user_inputs.step, "trainer_state": state}
    return user_inputs.prompts, completions, answers, kwargs, columns


def _check_inputs(
    specs: Sequence[RewardSpec],
    prompts: Sequence[str],
    completions: Sequence[str],
    answers: Sequence[str],
    batch_kwargs: Mapping[str, Sequence[Any]],
    user_inputs: UserInputs,
    timeout_s: float,
) -> None:
    n = len(completions)
    if len(prompts) != n or len(answers) != n or len(user_inputs.prompts) != n:
        raise ValueError(f"score got {len(prompts)} prompts, {n} completions and {len(answers)} answers")
    for key, values in {**batch_kwargs, **user_inputs.columns}.items():
        if len(values) != n:
            raise ValueError(f"score got {len(values)} values of {key!r} for {n} completions")
    names = [spec.name for spec in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"score got the same reward function twice: {names}")
    for spec in specs:
        clash = set(spec.kwargs) & set(batch_kwargs)
        if clash:
            raise ValueError(f"reward {spec.name!r} kwargs {sorted(clash)} clash with batch_kwargs")
    if not timeout_s > 0:
        raise ValueError(f"score needs timeout_s > 0, got {timeout_s}")


def _run_in_process(
    name: str,
    fn: RewardFn,
    prompts: Sequence[Any],
    completions: Sequence[str],
    answers: Sequence[str],
    kwargs: Mapping[str, Any],
    batch_kwargs: Mapping[str, Sequence[Any]],
) -> list[CallOutcome]:
    """The whole batch in one call; if it raises, one completion at a time to isolate the bad ones."""
    try:
        values = fn(list(prompts), list(completions), list(answers), **kwargs, **batch_kwargs)
    except Exception:
        return _one_at_a_time(fn, prompts, completions, answers, kwargs, batch_kwargs)
    return _split(name, values, len(completions))


def _one_at_a_time(fn, prompts, completions, answers, kwargs, batch_kwargs) -> list[CallOutcome]:
    outcomes = []
    for i in range(len(completions)):
        args, one_kwargs = _one_call(i, prompts, completions, answers, kwargs, batch_kwargs)
        outcomes.append(guarded_call(fn, args, one_kwargs))
    return outcomes


def _split(name: str, values: Any, n: int) -> list[CallOutcome]:
    """A whole-batch result as one outcome per completion; a wrong length makes each an error."""
    values = as_values(values)
    error = length_error(name, values, n)
    if error is not None:
        return [CallOutcome(error=error, bad_value=True) for _ in range(n)]
    if isinstance(values, LabelledRewards):
        return [
            CallOutcome(value=LabelledRewards([value], [label], values.kinds))
            for value, label in zip(values, values.labels, strict=True)
        ]
    return [CallOutcome(value=[value]) for value in values]


def _run_concurrently(
    resolved: Sequence[tuple[RewardSpec, RewardEntry]],
    prompts: Sequence[str],
    completions: Sequence[str],
    answers: Sequence[str],
    batch_kwargs: Mapping[str, Sequence[Any]],
    user_inputs: UserInputs,
) -> dict[str, list[CallOutcome]]:
    """A step's in-process `async def` rewards awaited together (TRL runs its async rewards the same way);
    one that raises is then called one completion at a time, as a synchronous one would be. The outcomes
    of those entries by name ({} when there is none)."""
    calls = [
        (spec, entry, _arguments(spec, entry, prompts, completions, answers, batch_kwargs, user_inputs))
        for spec, entry in resolved
        if not entry.isolated and _is_async(entry.fn)
    ]
    if not calls:
        return {}

    async def gather() -> list[Any]:
        coroutines = [entry.fn.acall(p, c, a, **kw, **bk) for _, entry, (p, c, a, kw, bk) in calls]
        return await asyncio.gather(*coroutines, return_exceptions=True)

    results = asyncio.run(gather())
    outcomes = {}
    for (spec, entry, args), values in zip(calls, results, strict=True):
        if isinstance(values, Exception):
            outcomes[spec.name] = _one_at_a_time(entry.fn, *args)
        else:
            outcomes[spec.name] = _split(spec.name, values, len(completions))
    return outcomes


def _run_in_pool(
    name: str, entry: RewardEntry, pool: RewardPool, args: tuple[Any, ...], timeout_s: float
) -> list[CallOutcome]:
    """One task per completion, so a hang costs one completion and the budget is per completion; an entry
    with `batch` > 1, one task per `batch` completions, and a task that raised once per completion.
    args: (prompts, completions, answers, kwargs, per-completion kwargs), from `_arguments`."""
    n = len(args[1])
    if entry.batch == 1:
        calls = [_one_call(i, *args) for i in range(n)]
        return pool.run(entry.fn, calls, timeout_s, entry.preload, entry.prepare)
    spans = [(lo, min(lo + entry.batch, n)) for lo in range(0, n, entry.batch)]
    calls = [_slice_call(lo, hi, *args) for lo, hi in spans]
    tasks = pool.run(entry.fn, calls, timeout_s, entry.preload, entry.prepare)
    outcomes: list[CallOutcome] = []
    for (lo, hi), task in zip(spans, tasks, strict=True):
        if task.timed_out or (task.error is not None and hi - lo == 1):
            outcomes += [task] * (hi - lo)
        elif task.error is not None:
            singles = [_one_call(i, *args) for i in range(lo, hi)]
            outcomes += pool.run(entry.fn, singles, timeout_s, entry.preload, entry.prepare)
        else:
            outcomes += _split(name, task.value, hi - lo)
    return outcomes


def _one_call(
    i: int,
    prompts: Sequence[Any],
    completions: Sequence[str],
    answers: Sequence[str],
    kwargs: Mapping[str, Any],
    batch_kwargs: Mapping[str, Sequence[Any]],
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Arguments for calling a function on completion i alone (per-completion data sliced to [i])."""
    return _slice_call(i, i + 1, prompts, completions, answers, kwargs, batch_kwargs)


def _slice_call(
    lo: int,
    hi: int,
    prompts: Sequence[Any],
    completions: Sequence[str],
    answers: Sequence[str],
    kwargs: Mapping[str, Any],
    batch_kwargs: Mapping[str, Sequence[Any]],
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Arguments for calling a function on completions lo..hi-1 (per-completion data sliced alike)."""
    some_kwargs = {**kwargs, **{key: list(values[lo:hi]) for key, values in batch_kwargs.items()}}
    return (list(prompts[lo:hi]), list(completions[lo:hi]), list(answers[lo:hi])), some_kwargs
