"""One run per run dir: the run holds an exclusive `flock` on `<run dir>/run.lock` until it exits.

The kernel drops a flock when its holder's file descriptor closes, so a crashed or SIGKILLed run leaves
no stale lock: the next run takes it over at once. The file keeps the holder's pid for the error message
of a second run (and for a person), not as the lock itself.

`HoldRunDir`, a Hydra callback (conf/config.yaml), takes the lock when the run starts, before Hydra opens
its log file and writes `.hydra/` into the dir: a refused run changes nothing of the holder's files. The
job takes it again (a no-op then) for a multirun's jobs, which that callback does not see.
"""

import copy
import fcntl
import os
import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, open_dict

LOCK_FILE = "run.lock"
# The run dir this process (or the grpo-run that launched it as a rank) holds: ranks inherit it, so rank 0
# of a self-launched run does not wait on its own launcher's lock.
HELD_ENV = "GRPO_RUN_LOCKED_DIR"

_held: list[int] = []  # the open descriptors: the locks last as long as the process


class RunDirBusy(RuntimeError):
    """Another live process holds this run dir."""


def hold_run_dir(run_dir: Path) -> None:
    """Take the run dir's lock for the rest of this process, or raise naming the dir and the holder."""
    if os.environ.get(HELD_ENV) == str(run_dir.resolve()):
        return  # held already, by this process or by the grpo-run that started this rank
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
    os.environ[HELD_ENV] = str(run_dir.resolve())


class HoldRunDir(Callback):
    """Take the run dir's lock before Hydra writes into it; a busy dir ends the run in one line (exit 1)."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        from grpo_run.engine.launch import adopt_launcher, is_main_process

        dist = copy.deepcopy(config.distributed)
        with open_dict(dist):
            adopt_launcher(dist)  # as the job will: a node > 0 or a rank > 0 writes nothing there
        if not is_main_process() or int(dist.node_rank) > 0:
            return
        run_dir = Path(str(config.hydra.run.dir))
        run_dir.mkdir(parents=True, exist_ok=True)
        try:
            hold_run_dir(run_dir)
        except RunDirBusy as err:
            print(f"grpo-run: {err}", file=sys.stderr)
            sys.exit(1)
