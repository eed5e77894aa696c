"""Faults of a 2-rank job (`distributed=zero2`, 2 CPU ranks over gloo) from outside, as a supervisor,
a preempted node or a hung rank would cause them: a stop signal to the launcher or to one rank, a
SIGKILL of the launcher, a rank that stops answering. What each leaves saved must be the checkpoint
one uninterrupted run of the same 3 steps saved at that step, byte for byte (the reference is shared by
every test: one 2-rank run is the expensive part), and one resume from it matches that run bit for bit.

A test-only `sitecustomize` (rank_hooks/, on PYTHONPATH) makes the chosen ranks wait at the start of
step 2 until they caught a stop signal, or stop themselves there (SIGSTOP), so each fault lands in a
known step. Every test kills what it started in a `finally`, ranks included, even when it fails.
"""

import contextlib
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from grpo_run import checkpoint
from grpo_run.checkpoint.manifest import MANIFEST
from grpo_run.safety.signals import EXIT_PREEMPTED
from tests.builders import ZERO2, alive, descendants, hook_env
from tests.helpers import FAST, GRPO_RUN, REPO, read_metrics

pytestmark = pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads /proc")

# 2 prompts x 4 completions per step, 2 micro-batches of 2 on each rank; a checkpoint after every step.
ARGS = [a for a in FAST if not a.startswith(("trainer.max_steps", "trainer.micro_batch_size"))] + [
    "trainer.max_steps=3",
    "trainer.micro_batch_size=2",
    "trainer.lr=1e-3",
    "logger=console",
    "logger.console=false",
    "checkpoint.every_steps=1",
    "checkpoint.keep_last=3",
    *ZERO2,
]
TIMEOUT_S = 30  # distributed.timeout_s of the stall test: short, yet above a loaded machine's start-up skew


def without_timings(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if not k.startswith("perf/")} for row in rows]


class Job:
    """`grpo-run ARGS` in its own session, its output in files (a rank that outlives the launcher would
    hold a pipe open); `close` kills the launcher and every process it started, found while they ran."""

    def __init__(self, run_dir: Path, extra: list[str], env: dict[str, str]) -> None:
        self.run_dir, self.seen = run_dir, set()
        run_dir.parent.mkdir(parents=True, exist_ok=True)
        self.log = run_dir.parent / f"{run_dir.name}.log"
        with self.log.open("w") as out:
            self.proc = subprocess.Popen(
                [GRPO_RUN, *ARGS, *extra, f"hydra.run.dir={run_dir}"],
                cwd=REPO,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def ranks(self) -> set[int]:
        self.seen |= descendants(self.proc.pid)
        return self.seen

    def wait(self, timeout: float) -> int:
        deadline = time.time() + timeout
        while self.proc.poll() is None and time.time() < deadline:
            self.ranks()
            time.sleep(0.2)
        return self.proc.wait(timeout=1)

    def output(self) -> str:
        return self.log.read_text()

    def close(self) -> None:
        pids = self.ranks() if self.proc.poll() is None else self.seen
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait()


def wait_for_files(folder: Path, names: list[str], job: Job, timeout: float = 240) -> list[str]:
    deadline = time.time() + timeout
    while time.time() < deadline:
        job.ranks()
        if all((folder / n).exists() for n in names):
            return [(folder / n).read_text() for n in names]
        assert job.proc.poll() is None, job.output()
        time.sleep(0.2)
    raise AssertionError(f"{names} never appeared in {folder}:\n{job.output()}")


def run(run_dir: Path, extra: list[str], timeout: float = 300) -> str:
    """A whole run in `run_dir` that must succeed; its output."""
    job = Job(run_dir, extra, hook_env())
    try:
        code = job.wait(timeout)
        assert code == 0, job.output()
        return job.output()
    finally:
        job.close()


def assert_resumes_to_the_reference(run_dir: Path, reference: Path, step: int) -> None:
    """`resume=auto` continues from `step`'s checkpoint and ends where the uninterrupted run ended."""
    out = run(run_dir, ["resume=auto"])
    assert f"(step {step})" in out, out
    assert without_timings(read_metrics(run_dir)) == without_timings(read_metrics(reference))
    ours, theirs = (
        load_file(run_dir / "final" / "model.safetensors"),
        load_file(reference / "final" / "model.safetensors"),
    )
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)


def assert_saved_as_the_reference(run_dir: Path, reference: Path, step: int) -> None:
    """The newest checkpoint is `step`'s and its weights, DeepSpeed's optimizer state and the trainer's
    state are byte for byte the uninterrupted run's (the manifest holds every file's sha256): it resumes
    as that one does (`assert_resumes_to_the_reference`, shown once). Not compared: the run's config (it
    names its own run dir) and the process RNG files (torch's global generator, which nothing in a step
    samples from: generation and the sampler draw from their own seeded generators)."""
    ours = newest(run_dir)
    assert ours.name == checkpoint.step_name(step) and checkpoint.damage(ours) is None

    def files(folder: Path) -> dict:
        listed = json.loads((folder / MANIFEST).read_text())["files"]
        return {n: e for n, e in listed.items() if n != "config.json" and not n.startswith("rng_rank")}

    saved, reference_files = files(ours), files(reference / checkpoint.CHECKPOINTS / ours.name)
    assert len(saved) > 3 and saved == reference_files


def newest(run_dir: Path) -> Path:
    return (
        run_dir / checkpoint.CHECKPOINTS / (run_dir / "checkpoints" / checkpoint.LATEST).read_text().strip()
    )


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    run(run_dir, [])
    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2, 3]
    return run_dir


def held_job(tmp_path: Path, hold_ranks: str, extra: list[str] = ()) -> tuple[Job, Path]:
    holds = tmp_path / "holds"
    holds.mkdir()
    env = hook_env(GRPO_TEST_HOLD_RANKS=hold_ranks, GRPO_TEST_HOLD_STEP="2", GRPO_TEST_HOLD_DIR=str(holds))
    return Job(tmp_path / "run", list(extra), env), holds


def test_sigterm_to_the_launcher_saves_on_every_rank_and_exits_75(tmp_path, reference):
    """`kill PID` of the command the user started (a supervisor, a container stop) as both ranks begin
    step 2: every rank leaves the step at its first stop point, step 1 is saved, and the launcher exits
    75; the resume matches the uninterrupted run."""
    job, holds = held_job(tmp_path, "0,1")
    try:
        wait_for_files(holds, ["rank0.held", "rank1.held"], job)
        job.proc.send_signal(signal.SIGTERM)
        assert job.wait(180) == EXIT_PREEMPTED, job.output()
        assert "stopped by SIGTERM after step 1" in job.output()
        assert not any(alive(pid) for pid in job.seen)
    finally:
        job.close()
    assert newest(tmp_path / "run").name == checkpoint.step_name(1)
    assert_resumes_to_the_reference(tmp_path / "run", reference, step=1)


def test_sigterm_to_one_rank_saves_on_every_rank_and_exits_75(tmp_path, reference):
    """One node of a multi-node job preempted: rank 1 alone gets SIGTERM as step 2 begins; the ranks
    agree at the step's first stop point, all save step 1, and the job exits 75 as for a signal to all."""
    job, holds = held_job(tmp_path, "1")
    try:
        (pid,) = wait_for_files(holds, ["rank1.held"], job)
        os.kill(int(pid), signal.SIGTERM)
        assert job.wait(180) == EXIT_PREEMPTED, job.output()
    finally:
        job.close()
    assert_saved_as_the_reference(tmp_path / "run", reference, step=1)


def test_sigkill_of_the_launcher_ends_every_rank_within_seconds(tmp_path, reference):
    """The launcher dies without a word while both ranks are inside step 2: they die with it, and the
    step-1 checkpoint is intact and resumes exactly."""
    job, holds = held_job(tmp_path, "0,1")
    try:
        wait_for_files(holds, ["rank0.held", "rank1.held"], job)
        ranks = set(job.ranks())
        assert len(ranks) >= 2
        job.proc.kill()
        job.proc.wait()
        deadline = time.time() + 15
        while any(alive(pid) for pid in ranks) and time.time() < deadline:
            time.sleep(0.2)
        assert not [pid for pid in ranks if alive(pid)], job.output()
    finally:
        job.close()
    assert_saved_as_the_reference(tmp_path / "run", reference, step=1)


def test_a_stalled_rank_ends_the_job_within_the_timeout_naming_it(tmp_path, reference):
    """Rank 1 stops (SIGSTOP) at the start of step 2 while rank 0 waits for it in a collective: the job
    ends about distributed.timeout_s later, one line names rank 1 and the step-1 checkpoint, nothing is
    left running, and the resume is exact."""
    holds = tmp_path / "holds"
    holds.mkdir()
    env = hook_env(GRPO_TEST_STALL_RANK="1", GRPO_TEST_STALL_STEP="2", GRPO_TEST_HOLD_DIR=str(holds))
    job = Job(tmp_path / "run", [f"distributed.timeout_s={TIMEOUT_S}"], env)
    try:
        (stalled,) = wait_for_files(holds, ["rank1.stalled"], job)
        pid, stopped_at = int(stalled.split()[0]), float(stalled.split()[1])
        assert job.wait(TIMEOUT_S + 120) == 1, job.output()
        # From the stall to the job's end: the timeout plus a margin (not 30 minutes of gloo's default).
        assert time.time() - stopped_at < TIMEOUT_S + 90
        assert not alive(pid) and not any(alive(p) for p in job.seen)
        last = job.output().strip().splitlines()[-1]
        assert f"rank 1 (pid {pid}) stopped answering" in last, job.output()
        assert f"distributed.timeout_s={TIMEOUT_S}" in last
        assert f"{checkpoint.step_name(1)} (step 1)" in last and "resume=auto" in last
    finally:
        job.close()
    assert_saved_as_the_reference(tmp_path / "run", reference, step=1)


@pytest.mark.slow
def test_a_rank_stalled_inside_the_gradient_reduction_ends_the_job_within_the_timeout(tmp_path, reference):
    """Rank 1 stops (SIGSTOP) inside step 2's ZeRO-2 gradient reduction while rank 0 waits for it in an
    all-reduce on the process group DeepSpeed made itself (its clone of the world group): that group
    carries distributed.timeout_s too, so the job ends about then, naming rank 1 and the step-1
    checkpoint (it ran 30 minutes of gloo's default before), and the resume is exact."""
    holds = tmp_path / "holds"
    holds.mkdir()
    env = hook_env(
        GRPO_TEST_STALL_RANK="1",
        GRPO_TEST_STALL_STEP="2",
        GRPO_TEST_STALL_IN="reduce",
        GRPO_TEST_HOLD_DIR=str(holds),
    )
    job = Job(tmp_path / "run", [f"distributed.timeout_s={TIMEOUT_S}"], env)
    try:
        (stalled,) = wait_for_files(holds, ["rank1.stalled"], job)
        pid, stopped_at = int(stalled.split()[0]), float(stalled.split()[1])
        assert job.wait(TIMEOUT_S + 120) == 1, job.output()
        assert time.time() - stopped_at < TIMEOUT_S + 90
        assert not alive(pid) and not any(alive(p) for p in job.seen)
        last = job.output().strip().splitlines()[-1]
        assert f"rank 1 (pid {pid}) stopped answering" in last, job.output()
        assert f"{checkpoint.step_name(1)} (step 1)" in last and "resume=auto" in last
    finally:
        job.close()
    assert_saved_as_the_reference(tmp_path / "run", reference, step=1)
    assert_resumes_to_the_reference(tmp_path / "run", reference, step=1)


ASYNC = ["rollout=async", "rollout.threads=1", "rollout.timeout_s=120"]


def worker_pid(output: str) -> int:
    (pid,) = re.findall(r"generation worker pid (\d+)", output)
    return int(pid)


def test_sigterm_to_an_async_job_on_two_ranks_saves_both_and_stops_the_worker(tmp_path):
    """rollout=async beside 2 ZeRO-2 ranks (the generation worker is rank 0's child), SIGTERM to the
    launcher as step 2 begins: both ranks leave the step (rank 0's wait for the worker's batch, rank 1's
    wait in the scatter), save step 1, the job exits 75, and the worker is gone with the ranks."""
    job, holds = held_job(tmp_path, "0,1", ASYNC)
    try:
        wait_for_files(holds, ["rank0.held", "rank1.held"], job)
        job.proc.send_signal(signal.SIGTERM)
        assert job.wait(180) == EXIT_PREEMPTED, job.output()
        assert "stopped by SIGTERM after step 1" in job.output()
        assert worker_pid(job.output()) in job.seen
        assert not any(alive(pid) for pid in job.seen)
    finally:
        job.close()
    saved = newest(tmp_path / "run")
    assert saved.name == checkpoint.step_name(1)


def test_a_dead_async_worker_on_two_ranks_ends_the_job_with_exit_1_after_both_save(tmp_path):
    """The generation worker dies (SIGKILL, as the OOM killer would) as it starts sampling batch 3, while
    rank 0 waits for that batch: rank 1 learns of it from rank 0's scatter (it never waits for the
    worker), both save step 2, and the job exits 1 with a line naming the worker, nothing left running.
    resume=auto trains step 3 from that checkpoint."""
    job = Job(tmp_path / "run", ASYNC, hook_env(GRPO_TEST_WORKER_DIE_AT_BATCH="3"))
    try:
        assert job.wait(240) == 1, job.output()
        assert worker_pid(job.output()) in job.seen
        assert not any(alive(pid) for pid in job.seen)
    finally:
        job.close()
    # Each rank says it (rank 1 learned of the dead worker from rank 0), then the launcher its summary.
    lines = job.output().strip().splitlines()
    said = [line for line in lines if "step 3 was not trained: the generation worker" in line]
    assert len(said) == 2 and all("died while generating" in line for line in said), job.output()
    assert all(f"{checkpoint.step_name(2)} (step 2), is saved" in line for line in said), job.output()
    assert f"continues from {newest(tmp_path / 'run')} (step 2)" in lines[-1], job.output()
    assert newest(tmp_path / "run").name == checkpoint.step_name(2)
    out = run(tmp_path / "run", [*ASYNC, "resume=auto"])
    assert "(step 2)" in out, out
