"""Launcher detection, Slurm layouts, the ranks' command line and environment, how the launcher
watches its ranks (real child processes stand in for ranks), and the DeepSpeed JSON."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from grpo_run.engine.deepspeed_engine import deepspeed_config
from grpo_run.engine.launch import (
    Layout,
    adopt_launcher,
    first_slurm_host,
    needs_self_launch,
    started_by_launcher,
)
from grpo_run.launcher import (
    EXIT_LOST_CONTACT,
    LAUNCHER_PID_VAR,
    SignalForwarder,
    kill_ranks,
    lost_contact,
    rank_command,
    rank_env,
    supervise,
)
from grpo_run.safety.signals import EXIT_PREEMPTED


def dist(**kw):
    base = dict(nproc_per_node=1, nnodes=1, node_rank=0, master_addr="127.0.0.1", master_port=29500)
    return SimpleNamespace(**{**base, **kw})


@pytest.mark.parametrize(
    ("nodelist", "host"),
    [("gpu07", "gpu07"), ("gpu[03-05,9]", "gpu03"), ("a[1,4],b2", "a1"), ("n1,n2", "n1")],
)
def test_first_slurm_host(nodelist, host):
    assert first_slurm_host(nodelist) == host


def test_torchrun_env_is_a_launcher():
    env = {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    assert started_by_launcher(env) == Layout(rank=3, world_size=8, local_rank=1, local_world_size=2)
    d = dist(nproc_per_node=1)
    adopt_launcher(d, env)
    assert (d.nproc_per_node, d.nnodes) == (2, 4)
    assert not needs_self_launch(d, env)


def test_srun_with_one_task_per_rank():
    env = {"SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_STEP_NUM_TASKS": "8"}
    env |= {"SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_NODELIST": "node[12-13]"}
    assert started_by_launcher(env) == Layout(rank=5, world_size=8, local_rank=1, local_world_size=4)
    d = dist()
    adopt_launcher(d, env)
    assert (d.nproc_per_node, d.nnodes, d.master_addr) == (4, 2, "node12")


def test_srun_with_one_task_per_node_launches_the_node_ranks():
    env = {"SLURM_PROCID": "1", "SLURM_NODEID": "1", "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NUM_NODES": "2"}
    env["SLURM_STEP_NODELIST"] = "gpu[01-02]"
    d = dist(nproc_per_node=8)
    adopt_launcher(d, env)
    assert (d.nnodes, d.node_rank, d.master_addr) == (2, 1, "gpu01")
    assert needs_self_launch(d, env)
    # Node 1's second GPU is global rank 8 + 1 of 16, meeting rank 0 at the first node's address.
    env = rank_env(d, local_rank=1, master_port=29500, env={})
    assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == (
        "9",
        "1",
        "16",
        "8",
    )
    assert (env["MASTER_ADDR"], env["MASTER_PORT"], env["GROUP_RANK"]) == ("gpu01", "29500", "1")
    assert env[LAUNCHER_PID_VAR] == str(os.getpid()) and env["OMP_NUM_THREADS"] == "1"


def test_a_plain_process_or_batch_script_is_not_a_launcher():
    assert started_by_launcher({}) is None
    assert started_by_launcher({"SLURM_PROCID": "0", "SLURM_NTASKS": "8"}) is None  # sbatch, no srun
    assert not needs_self_launch(dist(), {})
    assert needs_self_launch(dist(nproc_per_node=2), {})


def test_rank_command_pins_the_run_dir_and_keeps_the_overrides():
    cmd = rank_command(["model=tiny", "trainer.lr=0.1"], "/runs/x", "config")
    assert cmd[:3] == [sys.executable, "-m", "grpo_run.cli"]
    assert cmd[3:] == [
        "model=tiny",
        "trainer.lr=0.1",
        "hydra.run.dir=/runs/x",
        "hydra.output_subdir=null",
        "hydra/job_logging=stdout",
    ]
    assert rank_command([], "/r", "experiment")[3] == "--config-name=experiment"


def child(code: str) -> subprocess.Popen:
    """A stand-in rank: a real process running `code`, in its own session as the launcher starts ranks."""
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], start_new_session=True)


SLEEPS = "import time; time.sleep(120)"
# Stops on SIGTERM the way a rank does: it finishes (here: at once) and exits 75.
STOPS_ON_SIGTERM = """
    import signal, sys, time
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(75))
    time.sleep(120)
"""


def watched(ranks, timeout_s=60.0, forward=None):
    try:
        return supervise(ranks, timeout_s, forward or SignalForwarder(ranks))
    finally:
        kill_ranks(ranks)


def test_a_rank_that_gave_up_waiting_names_the_one_still_running_and_it_is_killed():
    ranks = {0: child(f"import sys; sys.exit({EXIT_LOST_CONTACT})"), 1: child(SLEEPS)}
    code, problem = watched(ranks, timeout_s=7)
    assert code == 1
    assert problem == (
        f"rank 1 (pid {ranks[1].pid}) stopped answering: rank 0 got no reply within "
        "distributed.timeout_s=7 s; killed it and ended the job"
    )
    assert ranks[1].returncode == -signal.SIGKILL


def test_a_stopped_rank_is_killed_too():
    ranks = {0: child(f"import sys, time; time.sleep(1); sys.exit({EXIT_LOST_CONTACT})"), 1: child(SLEEPS)}
    os.kill(ranks[1].pid, signal.SIGSTOP)  # a stopped process ignores everything but SIGKILL
    code, problem = watched(ranks)
    assert code == 1 and problem.startswith("rank 1 ")
    assert ranks[1].returncode == -signal.SIGKILL


def test_a_crashed_rank_ends_the_others_at_once_with_its_exit_code():
    ranks = {0: child(SLEEPS), 1: child("import sys; sys.exit(2)")}
    code, problem = watched(ranks)
    assert (code, problem) == (2, f"rank 1 (pid {ranks[1].pid}) failed (exit code 2); ended the other ranks")
    assert ranks[0].returncode == -signal.SIGKILL
    ranks = {0: child(SLEEPS), 1: child(SLEEPS)}
    os.kill(ranks[0].pid, signal.SIGKILL)
    assert watched(ranks) == (1, f"rank 0 (pid {ranks[0].pid}) was killed by SIGKILL; ended the other ranks")


def test_a_stop_signal_to_the_launcher_reaches_every_rank_and_the_job_exits_75():
    ranks = {r: child(STOPS_ON_SIGTERM) for r in (0, 1)}
    forward = SignalForwarder(ranks).install()
    try:
        time.sleep(2.0)  # both children have installed their handler (a loaded machine: generous)
        os.kill(os.getpid(), signal.SIGTERM)  # to this process, which stands for the launcher
        assert watched(ranks, forward=forward) == (EXIT_PREEMPTED, None)
    finally:
        forward.restore()
    assert [p.returncode for p in ranks.values()] == [EXIT_PREEMPTED, EXIT_PREEMPTED]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_ranks_that_all_finish_give_0():
    assert watched({0: child("pass"), 1: child("import time; time.sleep(1)")}) == (0, None)


# The rank side of the launcher's death: `die_with_launcher`, as cli.main calls it, in a grandchild.
RANK = """
import time
from grpo_run.launcher import die_with_launcher
die_with_launcher()
print("armed", flush=True)
time.sleep(120)
"""
LAUNCHER = """
import os, subprocess, sys, time
env = {**os.environ, "GRPO_RUN_LAUNCHER_PID": str(os.getpid())}
proc = subprocess.Popen([sys.executable, "-c", sys.argv[1]], env=env)
print(proc.pid, flush=True)
time.sleep(120)
"""


def gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl, /proc")
def test_a_rank_dies_with_the_launcher_even_by_sigkill():
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, RANK], stdout=subprocess.PIPE, text=True)
    rank = 0
    try:
        rank = int(launcher.stdout.readline())
        assert launcher.stdout.readline().strip() == "armed"
        launcher.kill()
        launcher.wait()
        deadline = time.time() + 10
        while time.time() < deadline and not gone(rank):
            time.sleep(0.1)
        assert gone(rank)
    finally:
        launcher.kill()
        if rank and not gone(rank):
            os.kill(rank, signal.SIGKILL)


def test_gloo_timeouts_and_lost_peers_are_told_from_other_errors():
    gloo = "[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 5000ms for recv"
    assert lost_contact(RuntimeError(gloo))
    assert lost_contact(
        RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]")
    )
    assert not lost_contact(RuntimeError("CUDA out of memory"))
    assert not lost_contact(ValueError(gloo))


def test_deepspeed_config_takes_batch_and_clipping_from_the_trainer():
    cfg = deepspeed_config(
        zero_stage=2,
        offload_optimizer=True,
        bf16=False,
        micro_batch_size=4,
        completions_per_step=64,
        world_size=4,
        max_grad_norm=0.5,
    )
    # 64 completions / 4 ranks = 16 per rank = 4 micro-batches of 4.
    assert (cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"]) == (4, 4)
    assert cfg["train_batch_size"] == 64 and cfg["gradient_clipping"] == 0.5
    # The loss is already the step's: sum over ranks, no division by the accumulation steps.
    assert cfg["gradient_allreduce_op"] == "sum" and cfg["managed_gradient_accumulation"] is False
    assert cfg["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
