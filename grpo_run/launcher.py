"""The launcher: `grpo-run distributed=zero2 distributed.nproc_per_node=8 ...` starts this node's ranks.

It validates the config once in the parent, pins Hydra's run dir, then starts `python -m grpo_run.cli
<same overrides>` once per rank with what torchrun would set (RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/
MASTER_PORT: torch's env:// rendezvous at rank 0), so every child joins as its rank
(`engine/launch.py`) and never launches again. The parent stays: it passes stop signals to the ranks,
reports the job's status (75 when the ranks stopped on a signal after saving), ends the ranks when one
fails or stops answering, and takes them with it when it dies. Light on import, like the CLI that
reads it before validation.
"""

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, MutableMapping
from pathlib import Path
from typing import Any

from grpo_run import early_signal
from grpo_run.engine.launch import free_port, world_size
from grpo_run.exit_codes import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_LOST_CONTACT, EXIT_PREEMPTED

# Child ranks write nothing beside rank 0's files: the parent already wrote .hydra/ and cli.log.
CHILD_HYDRA_OVERRIDES = ("hydra.output_subdir=null", "hydra/job_logging=stdout")


# The launcher's pid, in its ranks' environment: a rank dies with the launcher that started it.
LAUNCHER_PID_VAR = "GRPO_RUN_LAUNCHER_PID"


PR_SET_PDEATHSIG = 1  # linux/prctl.h


# What the launcher passes on to its ranks (it runs them in their own sessions, out of the terminal's
# and the job's process group).
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


# How often the launcher checks its ranks: a failed rank ends the others within about this long.
MONITOR_INTERVAL_S = 0.5


# After one rank gave up waiting for the others, how long the rest have to do the same before those
# still running count as the ones that stopped answering.
CONTACT_GRACE_S = 5.0


# gloo's words for a collective that timed out or lost its peer (a plain RuntimeError); NCCL's watchdog
# aborts the process instead.
LOST_CONTACT_MARKS = (
    "Timed out waiting",
    "Connection closed by peer",
    "Connection reset by peer",
    "gloo/transport",
)


def rank_command(overrides: list[str], run_dir: str, config_name: str) -> list[str]:
    """`python -m grpo_run.cli` with the job's overrides and its pinned run dir: what every rank runs."""
    cmd = [sys.executable, "-m", "grpo_run.cli"]
    if config_name != "config":
        cmd.append(f"--config-name={config_name}")
    return [*cmd, *overrides, f"hydra.run.dir={run_dir}", *CHILD_HYDRA_OVERRIDES]


def rank_env(dist: Any, local_rank: int, master_port: int, env: Mapping[str, str] = os.environ) -> dict:
    """What torchrun would give the rank (env:// rendezvous at rank 0's store), and the launcher's pid."""
    nproc = int(dist.nproc_per_node)
    layout = {
        "RANK": int(dist.node_rank) * nproc + local_rank,
        "WORLD_SIZE": world_size(dist),
        "LOCAL_RANK": local_rank,
        "LOCAL_WORLD_SIZE": nproc,
        "GROUP_RANK": int(dist.node_rank),
        "MASTER_ADDR": dist.master_addr,
        "MASTER_PORT": master_port,
        LAUNCHER_PID_VAR: os.getpid(),
    }
    return {
        **env,
        "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1"),
        **{k: str(v) for k, v in layout.items()},
    }


def self_launch(dist: Any, overrides: list[str], run_dir: str, config_name: str = "config") -> int:
    """Start this node's ranks, pass them the stop signals, watch them; the job's exit status.

    Every rank runs in its own session, so a terminal's Ctrl-C or a signal to this process's group
    reaches the ranks once, through the launcher. Whatever happens, no rank outlives this function.
    """
    port = int(dist.master_port) if int(dist.nnodes) > 1 else free_port()
    cmd = rank_command(overrides, run_dir, config_name)
    ranks: dict[int, subprocess.Popen] = {}
    forward = SignalForwarder(ranks).install()  # before the first rank starts: no stop signal is lost
    try:
        for local_rank in range(int(dist.nproc_per_node)):
            env = rank_env(dist, local_rank, port)
            ranks[int(env["RANK"])] = subprocess.Popen(cmd, env=env, start_new_session=True)
        forward.resend()
        code, problem = supervise(ranks, float(dist.timeout_s), forward)
    finally:
        kill_ranks(ranks)
        forward.restore()
    if problem is not None:
        where = resume_point(Path(run_dir)) if int(dist.node_rank) == 0 else "see node 0 for the checkpoint"
        print(f"grpo-run: {problem}; {where}", file=sys.stderr, flush=True)
    return code


class SignalForwarder:
    """While installed, SIGTERM / SIGUSR1 / SIGINT to the launcher go to every running rank: the ranks
    decide (finish the step and save, or stop at once on Ctrl-C) and agree among themselves."""

    def __init__(self, ranks: Mapping[int, subprocess.Popen]) -> None:
        self.ranks = ranks
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def install(self) -> "SignalForwarder":
        for signum in FORWARDED_SIGNALS:
            previous = signal.signal(signum, self._forward)
            self._previous[signum] = signal.SIG_DFL if early_signal.is_ours(previous) else previous
        self.signum = early_signal.take()  # one the command kept while it imported: for the ranks
        return self

    def resend(self) -> None:
        """Every rank started: a stop that came before or while they started reaches each of them (a rank
        that had it already ignores the second)."""
        if self.signum is not None:
            self._forward(self.signum, None)

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def _forward(self, signum: int, frame: object) -> None:
        self.signum = self.signum or signum
        for proc in self.ranks.values():
            if proc.poll() is None:
                proc.send_signal(signum)


def supervise(
    ranks: Mapping[int, subprocess.Popen], timeout_s: float, forward: SignalForwarder
) -> tuple[int, str | None]:
    """Wait until every rank has ended; (exit status, the one-line problem or None).

    A rank that crashed or was killed ends the others at once: they cannot go on without it. A rank
    that gave up waiting for the others (EXIT_LOST_CONTACT) leaves the rest a few seconds to do the
    same; those still running then are the ones that stopped answering, and are killed (SIGKILL also
    ends a stopped process). Ranks that stop together (75, or 130 on Ctrl-C) get `timeout_s` to finish.
    """
    settled = {0, EXIT_PREEMPTED, EXIT_LOST_CONTACT, -signal.SIGINT, EXIT_INTERRUPTED}
    deadline = None
    while True:
        codes = {rank: proc.poll() for rank, proc in ranks.items()}
        running = [rank for rank, code in codes.items() if code is None]
        failed = {rank: code for rank, code in codes.items() if code is not None and code not in settled}
        if failed:
            return _failure(ranks, failed, forward)
        lost = sorted(rank for rank, code in codes.items() if code == EXIT_LOST_CONTACT)
        if not running:
            return _outcome(set(codes.values()), lost, forward)
        if deadline is None and (lost or any(codes[r] not in (None, 0) for r in codes)):
            patient = lost or forward.signum == signal.SIGINT
            deadline = time.monotonic() + (CONTACT_GRACE_S if patient else timeout_s)
        if deadline is not None and time.monotonic() > deadline:
            if forward.signum == signal.SIGINT:
                return EXIT_INTERRUPTED, None  # Ctrl-C: the ranks still running are killed, as asked
            waited = f"rank {lost[0]}" if lost else "the ranks that had stopped"
            silent = ", ".join(f"rank {r} (pid {ranks[r].pid})" for r in running)
            return EXIT_FAILED, (
                f"{silent} stopped answering: {waited} got no reply within "
                f"distributed.timeout_s={timeout_s:g} s; killed it and ended the job"
            )
        time.sleep(MONITOR_INTERVAL_S)


def _failure(
    ranks: Mapping[int, subprocess.Popen], failed: dict[int, int], forward: SignalForwarder
) -> tuple[int, str]:
    rank, code = min(failed.items())
    if forward.signum is not None and code == -forward.signum:  # it came before the rank could catch it
        name = signal.Signals(forward.signum).name
        return 128 + forward.signum, f"rank {rank} ended by {name} before it could save (still starting)"
    how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"failed (exit code {code})"
    codes = set(failed.values())
    status = code if len(codes) == 1 and code > 0 else EXIT_FAILED  # e.g. 2 from a refused resume key
    return status, f"rank {rank} (pid {ranks[rank].pid}) {how}; ended the other ranks"


def _outcome(codes: set[int], lost: list[int], forward: SignalForwarder) -> tuple[int, str | None]:
    if forward.signum == signal.SIGINT:
        return EXIT_INTERRUPTED, None
    if lost:
        return EXIT_FAILED, (
            f"rank {lost[0]} lost contact with another rank (on another node: none of this node's is "
            "still running)"
        )
    return (EXIT_PREEMPTED if EXIT_PREEMPTED in codes else 0), None


def kill_ranks(ranks: Mapping[int, subprocess.Popen]) -> None:
    """SIGKILL every rank still running, with its process group (its reward workers), and reap it."""
    for proc in ranks.values():
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
    for proc in ranks.values():
        proc.wait()


def resume_point(run_dir: Path) -> str:
    """Which checkpoint `resume=auto` would continue from, for the launcher's last line."""
    from grpo_run import checkpoint

    try:
        folder = checkpoint.newest_intact(run_dir / checkpoint.CHECKPOINTS)
    except checkpoint.CheckpointError as err:
        return str(err)
    if folder is None:
        return "no checkpoint was saved: a rerun starts from step 0"
    step = checkpoint.read_state(folder).step
    return f"resume=auto (hydra.run.dir={run_dir}) continues from {folder} (step {step})"


def die_with_launcher(env: MutableMapping[str, str] = os.environ) -> None:
    """In a rank this launcher started: die by SIGKILL the moment the launcher dies, even by SIGKILL.

    The kernel sends it (prctl's PR_SET_PDEATHSIG); it fires when the thread that started the rank
    exits, here the launcher's main thread, which waits for the ranks until they end. A launcher that
    died before the call shows as another parent.
    """
    launcher = env.pop(LAUNCHER_PID_VAR, None)
    if launcher is None:
        return
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    else:
        threading.Thread(target=_watch_parent, args=(int(launcher),), daemon=True).start()
    if os.getppid() != int(launcher):
        os._exit(EXIT_FAILED)


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(MONITOR_INTERVAL_S)
    os._exit(EXIT_FAILED)


def lost_contact(err: BaseException) -> bool:
    """A collective that timed out (distributed.timeout_s) or whose peer went away."""
    text = str(err)
    return isinstance(err, RuntimeError) and any(mark in text for mark in LOST_CONTACT_MARKS)
