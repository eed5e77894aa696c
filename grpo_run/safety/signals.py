"""SIGTERM / SIGUSR1, what Slurm sends before a preemption or the time limit: stop promptly, save, exit.

The handler only records the signal (`stop.request_stop`); every long loop reads that flag and ends early,
the ranks agree at the next stop point (`stop.py`), the loop saves the last trained step and raises
`Preempted`, which `entry.py` turns into exit code `EXIT_PREEMPTED`. Because the handler never raises, a
second signal arriving during the save is ignored instead of killing the process half-way through
writing. If the process is still running `trainer.stop_within_s` after the signal, every thread's stack
goes to stderr, so the phase that did not stop in time shows in the log.

The handler is installed before anything loads (`trainer.train`). While the run still loads (data,
tokenizer, models, a teacher, the reward workers: `loading` is True) there is nothing to save, so the
first signal raises `LoadingStopped` in the main thread at once, wherever it is (a slow user hook, a
wait), and `train` turns it into `Preempted` (exit 75, requeue included). A load that runs inside one
long C call ends at its return; if the process still runs `trainer.stop_within_s` after the signal and
has still saved nothing, it exits 75 there (the run dir lock, the reward and generation workers go with
the process).

Under Slurm, SIGUSR1 (`#SBATCH --signal=USR1@120`: "120 s before the time limit") with
`checkpoint.slurm_requeue=true` also runs `scontrol requeue $SLURM_JOB_ID` after the save, so the job
comes back and resumes (`resume=auto`). SIGTERM never requeues: `scancel` sends it too, and a preemption
with Slurm's PreemptMode=REQUEUE requeues the job by itself.
"""

import faulthandler
import os
import shutil
import signal
import subprocess
import sys
import threading
from types import FrameType

from grpo_run import early_signal
from grpo_run.exit_codes import EXIT_PREEMPTED
from grpo_run.safety.stop import request_stop
from grpo_run.tracking import console

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
REQUEUE_SIGNAL = signal.SIGUSR1


class Preempted(Exception):
    """The run stopped on a signal after saving the checkpoint of `step`."""

    exit_code = EXIT_PREEMPTED  # also what W&B records (tracking/wandb_run.py)

    def __init__(self, step: int, signum: int, requeued: bool, saved: str = "checkpoint saved") -> None:
        name = signal.Signals(signum).name
        super().__init__(f"stopped by {name} after step {step}; {saved}")
        self.step = step
        self.signum = signum
        self.requeued = requeued


class LoadingStopped(BaseException):
    """Raised by the handler itself when a stop arrives while the run loads. A BaseException, as
    KeyboardInterrupt is: the `except Exception` of a loader or a user's hook must not turn it into a
    load error."""

    exit_code = EXIT_PREEMPTED


class SignalCatcher:
    """While active, SIGTERM and SIGUSR1 set `signum` instead of ending the process.

    Only the main thread can install signal handlers; elsewhere (a training call from a worker thread)
    the catcher stays inactive and the default actions apply.
    """

    def __init__(self, within_s: float | None = None, loading: bool = False) -> None:
        """within_s: trainer.stop_within_s; the stacks go to stderr if the process still runs that long
        after the first signal (None: never). loading: the run is not built yet (until `loaded`)."""
        self.signum: int | None = None
        self.within_s = within_s
        self._previous: dict[int, object] = {}
        # While True nothing can be saved yet, so a stop ends the run at once (`LoadingStopped`).
        self.loading = loading

    def loaded(self) -> None:
        """The run is built: from here on a stop is acted on at the loop's stop points and saves."""
        self.loading = False

    def install(self) -> "SignalCatcher":
        """Catch SIGTERM/SIGUSR1 from now on; one the command kept before (`early_signal`) is acted on
        now, as if it had come here (while loading: LoadingStopped)."""
        if threading.current_thread() is threading.main_thread():
            for signum in STOP_SIGNALS:
                previous = signal.signal(signum, self._record)
                self._previous[signum] = signal.SIG_DFL if early_signal.is_ours(previous) else previous
            kept = early_signal.take()
            if kept is not None:
                self._record(kept, None)
        return self

    def restore(self) -> None:
        """Put back the handlers that were there before `install`.

        After a stop signal the process is on its way out, and further stop signals are ignored
        (SIG_IGN) instead: a second SIGTERM arriving after a fast save must not kill the exit with the
        default action, and a Python handler would not do, since the interpreter's shutdown puts the
        default action back for signals that have one (a tiny run could save and reach that point
        within the 50 ms between two SIGTERMs; it then died with -15 instead of exiting 75).
        """
        if self.received:
            for signum in self._previous:
                signal.signal(signum, signal.SIG_IGN)
            return
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def __enter__(self) -> "SignalCatcher":
        return self.install()

    def __exit__(self, *exc_info: object) -> None:
        self.restore()

    @property
    def received(self) -> bool:
        return self.signum is not None

    def _record(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.signum is not None:
            os.write(2, f"grpo-run: {name} received again; ignored (already stopping)\n".encode())
            return
        self.signum = signum
        request_stop()
        loading = self.loading
        if loading:
            message = f"grpo-run: {name} received while the run was loading; stopping (nothing to save yet)\n"
        else:
            message = f"grpo-run: {name} received; stopping, then saving the last trained step\n"
        # os.write, not the rich console: a handler may interrupt a half-written console line.
        os.write(2, message.encode())
        if self.within_s is not None:
            watchdog = threading.Timer(self.within_s, self._overran, args=(name,))
            watchdog.daemon = True  # never keeps the process alive
            watchdog.start()
        if loading:  # nothing to save: leave whatever loads now (the caller says so and exits 75)
            raise LoadingStopped

    def _overran(self, name: str) -> None:
        """The stop took longer than its bound: say where every thread is. The run goes on stopping, unless
        it still had nothing to save (one long load call): then it exits 75 now."""
        _overran(name, self.within_s)
        if self.loading:
            os.write(2, f"grpo-run: nothing was saved before {name}; exiting {EXIT_PREEMPTED} now\n".encode())
            os._exit(EXIT_PREEMPTED)


def _overran(name: str, within_s: float) -> None:
    """The stop took longer than its bound: say where every thread is (the run goes on stopping)."""
    os.write(
        2, f"grpo-run: still running {within_s:g} s after {name} (trainer.stop_within_s); stacks:\n".encode()
    )
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)


def request_requeue(signum: int, enabled: bool) -> bool:
    """`scontrol requeue $SLURM_JOB_ID` after a SIGUSR1 under Slurm when enabled; True if it succeeded."""
    job_id = os.environ.get("SLURM_JOB_ID")
    if not enabled or signum != REQUEUE_SIGNAL or not job_id:
        return False
    scontrol = shutil.which("scontrol")
    if scontrol is None:
        console.print("[yellow]grpo-run: SLURM_JOB_ID is set but scontrol is not on PATH; not requeued")
        return False
    proc = subprocess.run([scontrol, "requeue", job_id], capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        console.print(f"[yellow]grpo-run: scontrol requeue {job_id} failed: {proc.stderr.strip()}")
        return False
    console.print(f"grpo-run: requeued Slurm job {job_id}")
    return True
