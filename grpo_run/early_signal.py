"""A stop signal that arrives before the trainer's handler exists is kept, not lost.

The `grpo-run` command installs this first (`grpo_run/console.py`), before Hydra, torch and transformers
import (seconds); the trainer's `SignalCatcher` takes the signal over when it installs and acts on it as
on one sent while the run loads: exit 75, requeue included. A mode that installs no catcher (plan, eval)
`release`s it: the default action, as if nothing had been caught. Standard library only, on purpose.
"""

import os
import signal
from types import FrameType

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
_pending: list[int] = []


def _keep(signum: int, frame: FrameType | None) -> None:
    if not _pending:
        _pending.append(signum)


def catch() -> None:
    """Keep SIGTERM/SIGUSR1 from now on until a catcher takes over (main thread only; idempotent)."""
    try:
        for signum in STOP_SIGNALS:
            if signal.getsignal(signum) in (signal.SIG_DFL, _keep):
                signal.signal(signum, _keep)
    except ValueError:  # not the main thread: signals keep their default action
        pass


def is_ours(handler: object) -> bool:
    """Whether `handler` is this module's: a catcher restores the default action instead of it."""
    return handler is _keep


def take() -> int | None:
    """The signal kept so far (None: none), handed to the caller, which now owns the stop."""
    return _pending.pop() if _pending else None


def release() -> None:
    """No catcher will take over: the default actions back, and a kept signal delivered again now."""
    try:
        for signum in STOP_SIGNALS:
            if signal.getsignal(signum) is _keep:
                signal.signal(signum, signal.SIG_DFL)
    except ValueError:
        return
    pending = take()
    if pending is not None:
        os.kill(os.getpid(), pending)
