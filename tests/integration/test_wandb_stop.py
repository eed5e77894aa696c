"""A run stopped by a signal is marked preempted in W&B, not failed: `mark_preempting`, then exit code
75 (W&B's contract for a run that is to be resumed); a run that fails keeps exit code 1. Read back from
the offline run's own `.wandb` file (no network: WANDB_MODE=offline, conftest)."""

import os
import signal
import subprocess
import sys
import time

from grpo_run.safety.signals import EXIT_PREEMPTED
from grpo_run.tracking.wandb_run import exit_code, finish_timeout_s
from tests.builders import QUIET
from tests.helpers import FAST, REPO
from tests.wandb_reader import read_records, run_files

WANDB = ["logger=wandb", "logger.console=false"]


def kinds(records) -> list[str]:
    return [r.WhichOneof("record_type") for r in records]


def test_a_run_stopped_by_a_signal_is_marked_preempted_with_exit_code_75(tmp_path):
    """SIGTERM in step 2's update (stop_probe holds it there): exit 75, and the W&B run's records end
    with a preempting record and an exit record of code 75."""
    run_dir, marker = tmp_path / "run", tmp_path / "phase.started"
    args = [*FAST, *QUIET, *WANDB, "trainer.max_steps=3", "trainer.micro_batch_size=1"]
    cmd = [
        sys.executable,
        "-m",
        "tests.integration.stop_probe",
        str(marker),
        "grpo_run.trainer:policy_update",
    ]
    proc = subprocess.Popen(
        [*cmd, "2", "--", *args, f"hydra.run.dir={run_dir}"],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "WANDB_MODE": "offline"},
    )
    try:
        deadline = time.time() + 240
        while not marker.exists():
            assert proc.poll() is None and time.time() < deadline, proc.communicate()[1]
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == EXIT_PREEMPTED, err
    (wandb_file,) = run_files(run_dir)
    records = read_records(wandb_file)
    assert "preempting" in kinds(records), kinds(records)
    (exit_record,) = [r.exit for r in records if r.WhichOneof("record_type") == "exit"]
    assert exit_record.exit_code == EXIT_PREEMPTED


def test_the_exit_code_w_and_b_records_and_the_finish_bound():
    from grpo_run.safety.signals import LoadingStopped, Preempted

    assert exit_code(None) == 0
    assert exit_code(Preempted(2, signal.SIGTERM, requeued=False)) == EXIT_PREEMPTED
    assert exit_code(LoadingStopped()) == EXIT_PREEMPTED
    assert exit_code(RuntimeError("a failed run")) == 1
    assert finish_timeout_s(20.0) == 10.0 and finish_timeout_s(0.5) == 1.0
