"""The process's stop request, and where the run may act on it.

A stop signal (`signals.py`) only records itself here. Every long loop then reads `stop_requested()`
where it can end early: the decode loop between decode steps, an episode between turns, the reward
pool while it waits, an evaluation between its generation calls, the update between micro-batches.
What may end early, and how, depends on whether other ranks must pass the same collectives:

- A loop with no collective inside just ends early (the decode loop stops decoding; the reward pool
  cancels its calls): what it returns is cut short, and the caller discards it at the next stop point.
- A stop point (`stop_point`) is a place every rank passes in the same order: there the ranks agree in
  one collective whether any was asked to stop, and all raise `StopRequested` together, so no rank is
  left waiting in a collective the others never reach.

Before a step's first optimizer step, and during an evaluation, `StopRequested` ends the step: the loop
saves the last trained step and exits (`trainer.py`). Between the later optimizer steps of a step
(grpo.num_iterations > 1) the pass under way is dropped and the state after the last optimizer step is
saved with what the rest of the step needs (`grpo_run/step_remainder.py`): a step is never half-applied
and never repeated.

rollout=async's worker is another process that ignores the signals: the trainer hands it an event
(`share`) set together with this process's flag, and the worker `follow`s it, so its decode loop and
reward calls end as promptly as the trainer's.
"""

import threading
from typing import Protocol


class StopRequested(Exception):
    """A stop arrived during a step or an evaluation: nothing of it is kept."""


class _Event(Protocol):
    def is_set(self) -> bool: ...

    def set(self) -> None: ...


_requested = threading.Event()
_followed: list[_Event] = []  # another process's events that stop this one (the async worker's)
_shared: list[_Event] = []  # events set together with this process's flag (for its children)


def request_stop() -> None:
    """Record a stop (the signal handler's only action besides a line on stderr)."""
    _requested.set()
    for event in _shared:
        event.set()


def stop_requested() -> bool:
    """Whether this process was asked to stop (by a signal, or by the process it follows)."""
    return _requested.is_set() or any(event.is_set() for event in _followed)


def raise_if_stopped() -> None:
    """For a phase without collectives (an evaluation): end it here when a stop was requested."""
    if stop_requested():
        raise StopRequested


def stop_point(broadcast_flag) -> None:
    """Where every rank passes in the same order: all raise StopRequested when any rank was asked to stop.

    broadcast_flag: the engine's `broadcast_flag` (True on every rank when it is True on some rank).
    """
    if broadcast_flag(stop_requested()):
        raise StopRequested


def follow(event: _Event) -> None:
    """This process stops when `event` is set (a child process following its parent's stop)."""
    _followed.append(event)


def share(event: _Event) -> None:
    """Set `event` whenever this process is asked to stop (already set if it was)."""
    _shared.append(event)
    if _requested.is_set():
        event.set()


def unshare(event: _Event) -> None:
    if event in _shared:
        _shared.remove(event)


def reset() -> None:
    """Forget the request and the events (a new run in the same process: tests, sweeps in one process)."""
    _requested.clear()
    _followed.clear()
    _shared.clear()
