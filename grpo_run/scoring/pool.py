"""The process pool that runs isolated reward calls: `RewardPool`, its workers, what one call came to.

Workers start by spawn (or forkserver), import what a call needs and run its preparation off the budget
clock, ignore the stop signals the trainer decides on, and die with the trainer. A call past its wall-clock
budget, or one still running when the run stops, is abandoned and its workers are killed; a worker that
dies is replaced and its wave scored again. `dispatch.score` decides which calls run here.
"""

from __future__ import annotations

import contextlib
import importlib
import multiprocessing
import multiprocessing.connection
import os
import signal
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any

from grpo_run.rewards.functions import RewardTimeoutError
from grpo_run.safety.stop import StopRequested, stop_requested
from grpo_run.scoring.registry import RewardFn
from grpo_run.scoring.user import UserReward


class RewardPoolError(RuntimeError):
    """The reward workers kept dying (or never started): the batch cannot be scored, so it is not trained.

    The message is one line; `detail` holds the last death's traceback."""

    def __init__(self, message: str, detail: str = "") -> None:
        super().__init__(message)
        self.detail = detail


@dataclass
class CallOutcome:
    """What one call came to: its return value, or an error's traceback, or a timeout. bad_value: the call
    returned, but not one value per completion (the error says how)."""

    value: Any = None
    error: str | None = None
    timed_out: bool = False
    bad_value: bool = False


def guarded_call(fn: RewardFn, args: tuple[Any, ...], kwargs: dict[str, Any]) -> CallOutcome:
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
                futures = [executor.submit(guarded_call, fn, args, kwargs) for args, kwargs in wave]
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
