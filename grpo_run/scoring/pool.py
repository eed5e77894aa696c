"""The safe caller the trainer uses: run every reward function on a batch and combine them.

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
import contextlib
import dataclasses
import importlib
import math
import multiprocessing
import multiprocessing.connection
import os
import signal
import threading
import time
import traceback
from collections.abc import Callable, Collection, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from typing import Any

from grpo_run.rewards.functions import LabelledRewards, RewardTimeoutError
from grpo_run.safety.stop import StopRequested, stop_requested
from grpo_run.scoring.registry import BUILTIN_REWARDS, RewardEntry, RewardFn, builtin_entry
from grpo_run.scoring.user import RewardTrainerState, UserReward

FAILURE_LABEL = "sandbox_failure"


class RewardPoolError(RuntimeError):
    """The reward workers kept dying (or never started): the batch cannot be scored, so it is not trained.

    The message is one line; `detail` holds the last death's traceback."""

    def __init__(self, message: str, detail: str = "") -> None:
        super().__init__(message)
        self.detail = detail


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


@dataclass
class CallOutcome:
    """What one call came to: its return value, or an error's traceback, or a timeout. bad_value: the call
    returned, but not one value per completion (the error says how)."""

    value: Any = None
    error: str | None = None
    timed_out: bool = False
    bad_value: bool = False


def _guarded_call(fn: RewardFn, args: tuple[Any, ...], kwargs: dict[str, Any]) -> CallOutcome:
    """`fn(*args, **kwargs)` with any exception turned into its traceback text (formatted where it happened,
    in the worker when run in the pool)."""
    try:
        return CallOutcome(value=as_values(fn(*args, **kwargs)))
    except RewardTimeoutError:
        return CallOutcome(error=traceback.format_exc(), timed_out=True)
    except Exception:
        return CallOutcome(error=traceback.format_exc())


def as_values(result: Any) -> Any:
    """A numpy array's or torch tensor's values as a plain list (read where it was made, in the pool's
    worker too, so a tensor never crosses a pipe); any other result as it came."""
    if isinstance(result, (list, tuple, str)) or not hasattr(result, "tolist"):
        return result
    values = result.tolist()
    return values if isinstance(values, list) else result  # a 0-d array is one value, not a result


# Slurm signals every process of a job, and Ctrl-C every process of the terminal's group: the trainer
# decides (finish the step and save, or exit 130) and then closes its workers, which must stay alive
# until then. Blocked in the parent while a worker starts, so they cannot kill the new process before
# its initializer ignores them (a signal mask survives fork and exec; a Python handler would not).
WORKER_IGNORED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
WATCHDOG_S = 0.5


def _die_with(parent_pid: int) -> None:
    """The worker exits as soon as the trainer does, even after a SIGKILL that runs no cleanup: a thread
    waits on multiprocessing's parent sentinel (a pipe the kernel closes when the parent dies; the
    parent's pid is polled where there is none). A dead worker also closes its end of the resource
    tracker's pipe, so the tracker exits too. (Not prctl's PR_SET_PDEATHSIG: it fires when the parent
    *thread* that started the worker exits, which a pool started from a short-lived thread would.)"""
    parent = multiprocessing.parent_process()

    def watch() -> None:
        if parent is not None:
            multiprocessing.connection.wait([parent.sentinel])
        else:
            while os.getppid() == parent_pid:
                time.sleep(WATCHDOG_S)
        os._exit(1)

    if os.getppid() != parent_pid:
        os._exit(1)  # the parent died before this thread could start
    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()


def _start_worker(modules: Sequence[str], parent_pid: int) -> None:
    _die_with(parent_pid)
    for signum in WORKER_IGNORED_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, WORKER_IGNORED_SIGNALS)  # a pending one is now discarded
    _import_modules(modules)


def _import_modules(modules: Sequence[str]) -> None:
    for module in modules:
        importlib.import_module(module)


def _prepare_worker(modules: Sequence[str], prepare: Callable[[], None] | None) -> None:
    _import_modules(modules)
    if prepare is not None:
        prepare()


class RewardPool:
    """Worker processes that run reward functions under a wall-clock budget per call.

    - Workers start with `start_method` "spawn" (default) or "forkserver", never "fork": the trainer holds
      threads and maybe CUDA. They start lazily, on the first `run`, and are reused across calls.
    - Any picklable top-level function can run here; before the budget clock starts, each worker set imports
      `preload` and the function's module, and runs the call's `prepare` (a model entry loads its model),
      so start-up, imports and loading are never charged to a completion.
      (With spawn, workers get the parent's `sys.path`, so a function defined in a test module works.)
    - A call still running at its budget is abandoned: the worker processes are killed and the pool is
      recreated on the next `run`, so `run` returns about `timeout_s` after the call began.
    - Calls run in waves of `max_workers`, each wave under one budget. With more than one worker, workers
      beyond the first may still be starting during the first wave; keep the default of 1 unless needed.
    Use as a context manager, or call `close()`.
    """

    def __init__(
        self,
        max_workers: int = 1,
        start_method: str = "spawn",
        preload: Sequence[str] = ("grpo_run.rewards.functions", "math_verify"),
        start_timeout_s: float = 120.0,
        max_restarts: int = 2,
    ) -> None:
        if max_workers < 1:
            raise ValueError(f"RewardPool needs max_workers >= 1, got {max_workers}")
        if start_method not in ("spawn", "forkserver"):
            raise ValueError(f"RewardPool start_method must be 'spawn' or 'forkserver', got {start_method!r}")
        self.max_workers = max_workers
        self.start_method = start_method
        self.preload = tuple(preload)
        self.start_timeout_s = start_timeout_s
        self.max_restarts = max_restarts
        self.restarts = 0  # workers found dead and replaced, over the pool's life
        self._executor: ProcessPoolExecutor | None = None
        self._imported: set[str] = set()
        self._prepared: set[Callable[[], None]] = set()  # the preparations this executor's worker ran

    def run(
        self,
        fn: RewardFn,
        calls: Sequence[tuple[tuple[Any, ...], dict[str, Any]]],
        timeout_s: float,
        preload: Sequence[str] = (),
        prepare: Callable[[], None] | None = None,
    ) -> list[CallOutcome]:
        """`fn(*args, **kwargs)` for each (args, kwargs) in `calls`, each within `timeout_s` seconds; the
        workers import `preload` (and fn's module) and run `prepare` first, off the budget clock.

        A wave whose worker dies (a signal, a crash, the OOM killer) is scored again by a fresh pool, up to
        `max_restarts` times; then `RewardPoolError`. A death is never scored as a reward error.
        """
        outcomes: list[CallOutcome] = []
        for start in range(0, len(calls), self.max_workers):
            if stop_requested():  # the run is stopping: what is left is abandoned, not started
                cancelled = CallOutcome(error="abandoned: the run is stopping", timed_out=True)
                return outcomes + [cancelled] * (len(calls) - start)
            wave = calls[start : start + self.max_workers]
            for _ in range(self.max_restarts + 1):
                wave_outcomes, died = self._run_wave(fn, wave, timeout_s, preload, prepare)
                if died is None:
                    break
                self.restarts += 1
            else:
                raise RewardPoolError(
                    f"reward workers for {_label(fn)} died {self.max_restarts + 1} times in a row",
                    f"the last reward worker death:\n{died}",
                )
            outcomes += wave_outcomes
        return outcomes

    def _run_wave(
        self,
        fn: RewardFn,
        wave,
        timeout_s: float,
        preload: Sequence[str] = (),
        prepare: Callable[[], None] | None = None,
    ) -> tuple[list[CallOutcome], str | None]:
        """(outcomes, None), or (partial, why) when a worker died or the pool could not start."""
        try:
            executor = self._ready_for(_module_of(fn), *preload, prepare=prepare)
            with _signals_blocked():  # a submit may start a worker
                futures = [executor.submit(_guarded_call, fn, args, kwargs) for args, kwargs in wave]
        except StopRequested:  # the run stops while the worker (re)starts: the wave is abandoned
            self._discard()
            return [CallOutcome(error="abandoned: the run is stopping", timed_out=True)] * len(wave), None
        except Exception:
            self._discard()
            return [], f"reward pool could not start:\n{traceback.format_exc()}"
        pending = _wait_unless_stopped(futures, timeout_s)
        outcomes = []
        died = None
        for future in futures:
            if future in pending:
                outcomes.append(CallOutcome(error=f"ran past its {timeout_s} s budget", timed_out=True))
                continue
            try:
                outcomes.append(future.result())
            except BrokenProcessPool:
                died = traceback.format_exc()
            except Exception:
                outcomes.append(CallOutcome(error=traceback.format_exc()))
        if pending or died is not None:
            self._discard()
        return outcomes, died

    def start(
        self, fn: RewardFn, preload: Sequence[str] = (), prepare: Callable[[], None] | None = None
    ) -> None:
        """Start the workers and prepare them for `fn` now (a model entry: load the model before the first
        step); what the preparation raised is raised here."""
        try:
            self._ready_for(_module_of(fn), *preload, prepare=prepare)
        except BaseException:
            self._discard()
            raise

    def close(self) -> None:
        """Stop the workers (they are idle between `run`s, so this returns promptly)."""
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _ready_for(self, *modules: str, prepare: Callable[[], None] | None = None) -> ProcessPoolExecutor:
        """The executor, started and with `modules` imported and `prepare` run in a worker, off the budget
        clock."""
        if self._executor is None:
            self._executor = ProcessPoolExecutor(
                max_workers=self.max_workers,
                mp_context=multiprocessing.get_context(self.start_method),
                initializer=_start_worker,
                initargs=(self.preload, os.getpid()),
            )
            self._imported = set()
            self._prepared = set()
        missing = tuple(m for m in modules if m not in self._imported)
        if prepare in self._prepared:
            prepare = None
        if missing or prepare is not None:
            # Waiting for this task also waits for the worker's start and its `preload` imports.
            with _signals_blocked():  # this submit starts the worker
                future = self._executor.submit(_prepare_worker, missing, prepare)
            # In slices: a (re)start that loads a reward model may take minutes, and a stop must not wait.
            if _wait_unless_stopped([future], self.start_timeout_s):
                if stop_requested():
                    raise StopRequested
                raise TimeoutError(f"the reward worker did not start within {self.start_timeout_s:g} s")
            future.result()
            self._imported.update(missing)
            if prepare is not None:
                self._prepared.add(prepare)
        return self._executor

    def _discard(self) -> None:
        """Kill the workers (one may be stuck in a call) and forget the executor; `run` makes a new one."""
        executor, self._executor = self._executor, None
        if executor is None:
            return
        # ProcessPoolExecutor has no public way to kill a busy worker before Python 3.14.
        processes = list((getattr(executor, "_processes", None) or {}).values())
        for process in processes:
            process.kill()
        executor.shutdown(wait=False, cancel_futures=True)
        for process in processes:
            process.join(timeout=5)


# How often a wave's wait looks at the stop flag: a stop cancels the calls still running.
STOP_POLL_S = 0.1


def _wait_unless_stopped(futures, timeout_s: float) -> set:
    """The futures not done within `timeout_s`, or when a stop is requested (safety/stop.py): the calls
    still running then are abandoned like those past their budget (the step they score is discarded)."""
    deadline = time.monotonic() + timeout_s
    pending = set(futures)
    while pending and not stop_requested():
        left = deadline - time.monotonic()
        if left <= 0:
            break
        _, pending = wait(pending, timeout=min(left, STOP_POLL_S))
    return pending


def _module_of(fn: RewardFn) -> str:
    """The module a worker imports before running `fn` (a user's reward: its target's module)."""
    return fn.module if isinstance(fn, UserReward) else fn.__module__


def _label(fn: RewardFn) -> str:
    return fn.target if isinstance(fn, UserReward) else f"{fn.__module__}.{getattr(fn, '__name__', fn)}"


@contextlib.contextmanager
def _signals_blocked():
    """The stop signals held back (pending, not lost) in this thread while it starts worker processes,
    which inherit the mask; the trainer's handlers run once they are unblocked."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, WORKER_IGNORED_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


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
    outcomes: dict[str, list[CallOutcome]] = {}
    own_pool = None
    started: list[RewardPool] = []
    try:
        concurrent = [(s, e) for s, e in resolved if not e.isolated and _is_async(e.fn)]
        if concurrent:
            outcomes |= _run_concurrently(
                concurrent, prompts, completions, answers, batch_kwargs, user_inputs
            )
        for spec, entry in resolved:
            if spec.name in outcomes:
                continue
            args = _arguments(spec, entry, prompts, completions, answers, batch_kwargs, user_inputs)
            if entry.isolated and entry.own_worker:
                target = (pools or {}).get(spec.name)
                if target is None:
                    target = entry_pool(entry)
                    started.append(target)
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

    _sum_by_weight(resolved, outcomes, result)
    return result


# A worker of its own loads a model before its first call: that may take longer than importing modules.
MODEL_START_TIMEOUT_S = 600.0


def entry_pool(entry: RewardEntry) -> RewardPool:
    """The pool of an `own_worker` entry: one worker process, which imports only what the entry needs."""
    return RewardPool(max_workers=1, preload=entry.preload, start_timeout_s=MODEL_START_TIMEOUT_S)


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


def _sum_by_weight(
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
        outcomes.append(_guarded_call(fn, args, one_kwargs))
    return outcomes


def _split(name: str, values: Any, n: int) -> list[CallOutcome]:
    """A whole-batch result as one outcome per completion; a wrong length makes each an error."""
    values = as_values(values)
    error = _length_error(name, values, n)
    if error is not None:
        return [CallOutcome(error=error, bad_value=True) for _ in range(n)]
    if isinstance(values, LabelledRewards):
        return [
            CallOutcome(value=LabelledRewards([value], [label], values.kinds))
            for value, label in zip(values, values.labels, strict=True)
        ]
    return [CallOutcome(value=[value]) for value in values]


def _run_concurrently(
    specs: Sequence[tuple[RewardSpec, RewardEntry]],
    prompts: Sequence[str],
    completions: Sequence[str],
    answers: Sequence[str],
    batch_kwargs: Mapping[str, Sequence[Any]],
    user_inputs: UserInputs,
) -> dict[str, list[CallOutcome]]:
    """A step's in-process `async def` rewards awaited together (TRL runs its async rewards the same way);
    one that raises is then called one completion at a time, as a synchronous one would be."""
    calls = [
        (spec, entry, _arguments(spec, entry, prompts, completions, answers, batch_kwargs, user_inputs))
        for spec, entry in specs
    ]

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


def _length_error(name: str, values: Any, expected: int) -> str | None:
    if isinstance(values, Sequence) and not isinstance(values, str) and len(values) == expected:
        return None
    got = f"{len(values)} values" if isinstance(values, Sequence) else f"a {type(values).__name__}"
    return f"reward function {name!r} returned {got} for {expected} completions"


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
            error = _length_error(name, outcome.value, 1)
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
    return _length_error("", outcome.value, 1) or _as_reward(outcome.value[0])[1]


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
