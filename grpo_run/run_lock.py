"""One run per run dir: the run holds an exclusive `flock` on `<run dir>/run.lock` until it exits.

The kernel drops a flock when its holder's file descriptor closes, so a crashed or SIGKILLed run leaves
no stale lock: the next run takes it over at once. The file keeps the holder's pid for the error message
of a second run (and for a person), not as the lock itself.
"""

import fcntl
import os
from pathlib import Path

LOCK_FILE = "run.lock"

_held: list[int] = []  # the open descriptors: the locks last as long as the process


class RunDirBusy(RuntimeError):
    """Another live process holds this run dir."""


def hold_run_dir(run_dir: Path) -> None:
    """Take the run dir's lock for the rest of this process, or raise naming the dir and the holder."""
    path = run_dir / LOCK_FILE
    # O_CLOEXEC: reward workers and launched ranks never inherit (and keep alive) the trainer's lock.
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise RunDirBusy(
            f"run dir {run_dir.resolve()} is in use by another grpo-run (pid {holder}); "
            "wait for it to finish, or give this run its own hydra.run.dir"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    _held.append(fd)
