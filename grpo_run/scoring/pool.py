"""The safe caller the trainer uses: run every reward function on a batch and combine them.

`score` never lets one bad completion sink a step, and never hides a failure in a silent 0:
- A function that raises: it is called again one completion at a time to find the bad completions; each of
  those gets 0 for that function and counts in `errors`; the first traceback is kept in `first_error` so the
  caller can log it once.
- A completion that runs out of time (past `timeout_s` in the pool, or a function raising
  `RewardTimeoutError`) gets 0 for that function and counts in `timeouts`, apart from errors.
- None from a function means "cannot be scored" (an unparseable gold): that completion's total is None and it
  counts in `unscorable`; the caller decides what to do with it (for example drop its group).
- A function that returns the wrong number of values is a programming error: `RewardLengthError`, at once.
- A function that labels its values (`LabelledRewards`, e.g. code_exec's "passed", "timeout", ...) has its
  labels counted per kind in `labels` ("code_exec/passed" -> n), every kind of it present, zeros included.
- For the functions in the registry's UNSCORABLE_ON_FAILURE (code_exec), an error or timeout of the call
  itself (the pool's budget, a dead worker) is an infrastructure failure: that completion gets None
  (unscorable), is still counted in `errors` / `timeouts`, and is labelled "sandbox_failure".

Functions that can hang or need a main thread (math-verify and its `signal.alarm`) run in a `RewardPool`
of worker processes, one completion per task, each under the wall-clock budget `timeout_s`. The cheap ones
(format, overlong_penalty, target_char_fraction) run in-process on the whole batch and have no budget.
"""

from __future__ import annotations

import contextlib
import importlib
import math
import multiprocessing
import multiprocessing.connection
import os
import signal
import threading
import time
import traceback
from collections.abc import Collection, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from typing import Any

from grpo_run.rewards.functions import LabelledRewards, RewardTimeoutError
from grpo_run.scoring.registry import (
    ISOLATED_REWARDS,
    REWARD_KINDS,
    UNSCORABLE_ON_FAILURE,
    RewardFn,
    get_reward_fn,
)

FAILURE_LABEL = "sandbox_failure"


class RewardLengthError(RuntimeError):
    """A reward function returned a number of values different from the number of completions."""


class RewardPoolError(RuntimeError):
    """The reward workers kept dying (or never started): the batch cannot be scored, so it is not trained.

    The message is one line; `detail` holds the last death's traceback."""

    def __init__(self, message: str, detail: str = "") -> None:
        super().__init__(message)
        self.detail = detail


@dataclass(frozen=True)
class RewardSpec:
    """One reward function of the total: registry name, weight in the sum, keyword hyper-parameters."""

    name: str
    weight: float = 1.0
    kwargs: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # A RewardName member becomes its plain string, so names compare and hash like the YAML value.
        object.__setattr__(self, "name", getattr(self.name, "value", self.name))


@dataclass
class ScoreResult:
    """Rewards of one batch.

    total: weighted sum over functions per completion; None when any function said None for it.
    per_function: each function's values by spec name (errors and timeouts appear as 0.0).
    errors / timeouts: counts of (function, completion) cells that raised / ran out of time.
    unscorable: number of completions whose total is None.
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


@dataclass
class CallOutcome:
    """What one call in the pool came to: its return value, or an error's traceback, or a timeout."""

    value: Any = None
    error: str | None = None
    timed_out: bool = False


def _guarded_call(fn: RewardFn, args: tuple[Any, ...], kwargs: dict[str, Any]) -> CallOutcome:
    """`fn(*args, **kwargs)` with any exception turned into its traceback text (formatted where it happened,
    in the worker when run in the pool)."""
    try:
        return CallOutcome(value=fn(*args, **kwargs))
    except RewardTimeoutError:
        return CallOutcome(error=traceback.format_exc(), timed_out=True)
    except Exception:
        return CallOutcome(error=traceback.format_exc())


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


class RewardPool:
    """Worker processes that run reward functions under a wall-clock budget per call.

    - Workers start with `start_method` "spawn" (default) or "forkserver", never "fork": the trainer holds
      threads and maybe CUDA. They start lazily, on the first `run`, and are reused across calls.
    - Any picklable top-level function can run here; before the budget clock starts, each worker set imports
      `preload` and the function's module, so start-up and imports are never charged to a completion.
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

    def run(
        self,
        fn: RewardFn,
        calls: Sequence[tuple[tuple[Any, ...], dict[str, Any]]],
        timeout_s: float,
    ) -> list[CallOutcome]:
        """`fn(*args, **kwargs)` for each (args, kwargs) in `calls`, each within `timeout_s` seconds.

        A wave whose worker dies (a signal, a crash, the OOM killer) is scored again by a fresh pool, up to
        `max_restarts` times; then `RewardPoolError`. A death is never scored as a reward error.
        """
        outcomes: list[CallOutcome] = []
        for start in range(0, len(calls), self.max_workers):
            wave = calls[start : start + self.max_workers]
            for _ in range(self.max_restarts + 1):
                wave_outcomes, died = self._run_wave(fn, wave, timeout_s)
                if died is None:
                    break
                self.restarts += 1
            else:
                raise RewardPoolError(
                    f"reward workers for {fn.__module__}.{fn.__name__} died {self.max_restarts + 1} times "
                    "in a row",
                    f"the last reward worker death:\n{died}",
                )
            outcomes += wave_outcomes
        return outcomes

    def _run_wave(self, fn: RewardFn, wave, timeout_s: float) -> tuple[list[CallOutcome], str | None]:
        """(outcomes, None), or (partial, why) when a worker died or the pool could not start."""
        try:
            executor = self._ready_for(fn.__module__)
            with _signals_blocked():  # a submit may start a worker
                futures = [executor.submit(_guarded_call, fn, args, kwargs) for args, kwargs in wave]
        except Exception:
            self._discard()
            return [], f"reward pool could not start:\n{traceback.format_exc()}"
        _, pending = wait(futures, timeout=timeout_s)
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

    def close(self) -> None:
        """Stop the workers (they are idle between `run`s, so this returns promptly)."""
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _ready_for(self, module: str) -> ProcessPoolExecutor:
        """The executor, started and with `module` imported in a worker, off the budget clock."""
        if self._executor is None:
            self._executor = ProcessPoolExecutor(
                max_workers=self.max_workers,
                mp_context=multiprocessing.get_context(self.start_method),
                initializer=_start_worker,
                initargs=(self.preload, os.getpid()),
            )
            self._imported = set()
        if module not in self._imported:
            # Waiting for this task also waits for the worker's start and its `preload` imports.
            with _signals_blocked():  # this submit starts the worker
                future = self._executor.submit(_import_modules, (module,))
            future.result(timeout=self.start_timeout_s)
            self._imported.add(module)
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
    functions: Mapping[str, RewardFn] | None = None,
    isolated: Collection[str] | None = None,
) -> ScoreResult:
    """Score one batch with every spec and sum them by weight (see the module docstring for the rules).

    timeout_s: wall-clock budget per completion for the functions that run in the pool.
    pool: reused across calls when given; otherwise one is started for this call only (if needed) and closed.
    batch_kwargs: per-completion data passed to every function as keywords, one entry per completion, as
        plain Python lists (e.g. {"completion_lengths": [...]} for overlong_penalty; not tensors, which would
        make each pool worker import torch); sliced to [value] when a function is called per completion.
    functions: name -> function, looked up before the registry (lets tests and callers add functions).
    isolated: names that run in the pool; default: the registry's ISOLATED_REWARDS (math_verifier).
    """
    n = len(completions)
    batch_kwargs = dict(batch_kwargs or {})
    _check_inputs(specs, prompts, completions, answers, batch_kwargs, timeout_s)
    functions = functions or {}
    isolated = {str(name.value) for name in ISOLATED_REWARDS} if isolated is None else set(isolated)
    resolved = [(spec, functions.get(spec.name) or get_reward_fn(spec.name)) for spec in specs]

    result = ScoreResult(total=[0.0] * n, per_function={})
    own_pool = None
    try:
        for spec, fn in resolved:
            args = (prompts, completions, answers, spec.kwargs, batch_kwargs)
            if spec.name in isolated:
                if pool is None:
                    pool = own_pool = RewardPool()
                before = pool.restarts
                try:
                    outcomes = _run_in_pool(fn, pool, *args, timeout_s)
                finally:
                    result.restarts += pool.restarts - before
            else:
                outcomes = _run_in_process(spec.name, fn, *args)
            result.per_function[spec.name] = _tally(spec.name, outcomes, result)
            _count_labels(spec.name, outcomes, result)
    finally:
        if own_pool is not None:
            own_pool.close()

    for spec in specs:
        for i, value in enumerate(result.per_function[spec.name]):
            total = result.total[i]
            result.total[i] = None if value is None or total is None else total + spec.weight * value
    result.unscorable = sum(total is None for total in result.total)
    return result


def _check_inputs(
    specs: Sequence[RewardSpec],
    prompts: Sequence[str],
    completions: Sequence[str],
    answers: Sequence[str],
    batch_kwargs: Mapping[str, Sequence[Any]],
    timeout_s: float,
) -> None:
    n = len(completions)
    if len(prompts) != n or len(answers) != n:
        raise ValueError(f"score got {len(prompts)} prompts, {n} completions and {len(answers)} answers")
    for key, values in batch_kwargs.items():
        if len(values) != n:
            raise ValueError(f"score got {len(values)} values of batch_kwargs[{key!r}] for {n} completions")
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
    prompts: Sequence[str],
    completions: Sequence[str],
    answers: Sequence[str],
    kwargs: Mapping[str, Any],
    batch_kwargs: Mapping[str, Sequence[Any]],
) -> list[CallOutcome]:
    """The whole batch in one call; if it raises, one completion at a time to isolate the bad ones."""
    try:
        values = fn(list(prompts), list(completions), list(answers), **kwargs, **batch_kwargs)
    except Exception:
        pass
    else:
        _check_length(name, values, len(completions))
        if isinstance(values, LabelledRewards):
            return [
                CallOutcome(value=LabelledRewards([value], [label], values.kinds))
                for value, label in zip(values, values.labels, strict=True)
            ]
        return [CallOutcome(value=[value]) for value in values]
    outcomes = []
    for i in range(len(completions)):
        args, one_kwargs = _one_call(i, prompts, completions, answers, kwargs, batch_kwargs)
        outcomes.append(_guarded_call(fn, args, one_kwargs))
    return outcomes


def _run_in_pool(
    fn: RewardFn,
    pool: RewardPool,
    prompts: Sequence[str],
    completions: Sequence[str],
    answers: Sequence[str],
    kwargs: Mapping[str, Any],
    batch_kwargs: Mapping[str, Sequence[Any]],
    timeout_s: float,
) -> list[CallOutcome]:
    """One task per completion, so a hang costs one completion and the budget is per completion."""
    calls = [
        _one_call(i, prompts, completions, answers, kwargs, batch_kwargs) for i in range(len(completions))
    ]
    return pool.run(fn, calls, timeout_s)


def _one_call(
    i: int,
    prompts: Sequence[str],
    completions: Sequence[str],
    answers: Sequence[str],
    kwargs: Mapping[str, Any],
    batch_kwargs: Mapping[str, Sequence[Any]],
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Arguments for calling a function on completion i alone (per-completion data sliced to [i])."""
    one_kwargs = {**kwargs, **{key: [values[i]] for key, values in batch_kwargs.items()}}
    return ([prompts[i]], [completions[i]], [answers[i]]), one_kwargs


def _check_length(name: str, values: Any, expected: int) -> None:
    if not isinstance(values, Sequence) or len(values) != expected:
        got = len(values) if isinstance(values, Sequence) else type(values).__name__
        raise RewardLengthError(f"reward function {name!r} returned {got} values for {expected} completions")


def _tally(name: str, outcomes: Sequence[CallOutcome], result: ScoreResult) -> list[float | None]:
    """One value per completion from the outcomes (each holding a 1-element list); counts into `result`."""
    values: list[float | None] = []
    failed = None if name in {str(n.value) for n in UNSCORABLE_ON_FAILURE} else 0.0
    for i, outcome in enumerate(outcomes):
        error = outcome.error
        value: float | None = 0.0
        if outcome.timed_out:
            result.timeouts += 1
            error = None
            value = failed
        elif error is None:
            _check_length(name, outcome.value, 1)
            value, error = _as_reward(outcome.value[0])
        if error is not None:
            result.errors += 1
            value = 0.0 if outcome.error is None else failed
            if result.first_error is None:
                result.first_error = f"reward function {name!r} failed on completion {i}:\n{error}"
        values.append(value)
    return values


def _count_labels(name: str, outcomes: Sequence[CallOutcome], result: ScoreResult) -> None:
    """Count the labels of a labelling function's values, every kind of it (registry or values) present."""
    kinds = list(REWARD_KINDS.get(name, ()))
    labels = []
    for outcome in outcomes:
        if isinstance(outcome.value, LabelledRewards):
            kinds += [k for k in outcome.value.kinds if k not in kinds]
            labels += outcome.value.labels
        elif outcome.error is not None and name in {str(n.value) for n in UNSCORABLE_ON_FAILURE}:
            labels.append(FAILURE_LABEL)
    if not kinds:
        return
    if FAILURE_LABEL in labels and FAILURE_LABEL not in kinds:
        kinds.append(FAILURE_LABEL)
    for kind in kinds:
        result.labels[f"{name}/{kind}"] = labels.count(kind)


def _as_reward(value: Any) -> tuple[float | None, str | None]:
    """(reward, None), or (0.0, why) when the value is neither None nor a finite number."""
    if value is None:
        return None, None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return 0.0, f"returned {value!r}, not a number"
    if not math.isfinite(number):
        return 0.0, f"returned {number}, not a finite number"
    return number, None
