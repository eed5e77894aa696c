"""A stop signal is honoured within `trainer.stop_within_s` in every phase of a step, and what it leaves
resumes to the uninterrupted run.

Each run goes through the real command (`stop_probe.py` runs `grpo-run` with one function wrapped to
mark when its phase begins and to hold there until the signal arrived). The phases are made long by
their settings (long completions, a large evaluation, a slow reward): ignoring the stop until the step
ends would take far longer than the bound, and would save the step the signal arrived in, where a
prompt stop saves the step before it.
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from grpo_run import checkpoint
from grpo_run.safety.signals import EXIT_PREEMPTED
from tests.builders import QUIET, alive, descendants, run_here
from tests.helpers import FAST, REPO, read_metrics

BOUND_S = 10.0  # trainer.stop_within_s of these runs
BASE = [*FAST, *QUIET, "trainer.max_steps=3", "checkpoint.every_steps=1", f"trainer.stop_within_s={BOUND_S}"]
LONG_SAMPLING = ["generation.max_new_tokens=400"]
# 64 problems, greedy and 4 samples each, up to 900 tokens: minutes on the tiny model if not cut short.
LONG_EVAL = ["eval.every_steps=2", "eval.num_prompts=64", "eval.max_new_tokens=900", "eval.batch_size=8"]
SMALL_EVAL = ["eval.every_steps=2", "eval.num_prompts=4", "eval.max_new_tokens=8"]
SLOW = "tests.integration.hanging_reward.slow_from_marked_call"
SLOW_REWARD = [f"reward.functions=[{{_target_: {SLOW}, isolated: true}}]", "reward.timeout_s=120"]


def without_timings(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if not k.startswith("perf/")} for row in rows]


def newest(run_dir: Path) -> int | None:
    latest = run_dir / checkpoint.CHECKPOINTS / checkpoint.LATEST
    return (
        checkpoint.read_state(run_dir / checkpoint.CHECKPOINTS / latest.read_text().strip()).step
        if latest.exists()
        else None
    )


class Stopped:
    """The run's exit code, the seconds from the signal to its exit, its stderr."""

    def __init__(self, code: int, seconds: float, err: str) -> None:
        self.code, self.seconds, self.err = code, seconds, err


def stop_in_phase(tmp_path: Path, target: str, nth: int, args: list[str], env=None) -> Stopped:
    """Run grpo-run ARGS; SIGTERM it once `target`'s call number `nth` began; wait for its exit."""
    marker = tmp_path / "phase.started"
    cmd = [sys.executable, "-m", "tests.integration.stop_probe", str(marker), target, str(nth), "--"]
    proc = subprocess.Popen(
        [*cmd, *args, f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    )
    children: set[int] = set()
    try:
        deadline = time.time() + 240
        while not marker.exists():
            assert proc.poll() is None and time.time() < deadline, proc.communicate()[1]
            children |= descendants(proc.pid)
            time.sleep(0.02)
        children |= descendants(proc.pid)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=180)
        seconds = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    time.sleep(0.5)  # a child killed by the exit may take a moment to be reaped
    assert not [pid for pid in children if alive(pid)], "processes left behind"
    return Stopped(proc.returncode, seconds, err)


def assert_stopped_in(stopped: Stopped, run_dir: Path, *, saved: int | None, logged: list[int]) -> None:
    assert stopped.code == EXIT_PREEMPTED, stopped.err
    assert stopped.seconds < BOUND_S, (stopped.seconds, stopped.err)
    assert "still running" not in stopped.err  # the watchdog never had to speak
    assert stopped.err.count("resume=auto") == 1, stopped.err  # one piece of advice, naming the run folder
    assert newest(run_dir) == saved
    rows = read_metrics(run_dir) if (run_dir / "metrics.jsonl").exists() else []
    assert [r["step"] for r in rows] == logged


PHASES = {
    # phase: (wrapped function, its call, extra settings, the step saved, the steps logged)
    "sampling": ("grpo_run.rollout.generate:decode", 2, LONG_SAMPLING, 1, [1]),
    "update": ("grpo_run.trainer:policy_update", 2, ["trainer.micro_batch_size=1"], 1, [1]),
    # μ = 3: call 5 is step 2's second pass; the state after its first optimizer step is saved
    # (step_00000002-iter1, whose state file says step 1), and step 2 is not logged
    "update after its first optimizer step": (
        "grpo_run.trainer:policy_update",
        5,
        ["grpo.num_iterations=3", "trainer.micro_batch_size=1"],
        1,
        [1],
    ),
    "evaluation at step 0": ("grpo_run.trainer:evaluate_run", 1, LONG_EVAL, None, []),
    # step 2 is trained and saved with its metrics unlogged: the resume evaluates it and logs it once
    # (a small evaluation: step 0's runs whole first)
    "evaluation after a step": ("grpo_run.trainer:evaluate_run", 2, SMALL_EVAL, 2, [0, 1]),
    "multi-turn episode": (
        "grpo_run.rollout.episodes:run_episodes",
        2,
        ["env=calculator", "generation.max_new_tokens=32", "env.max_turns=8"],
        1,
        [1],
    ),
    # the teacher's no-gradient pass stops between its micro-batches (self-distillation: no second model)
    "distillation teacher": (
        "grpo_run.teacher:SelfTeacher.logprobs",
        2,
        ["distill=self", "trainer.micro_batch_size=1"],
        1,
        [1],
    ),
    "async worker": (
        "grpo_run.asynchronous.source:AsyncRollouts._next",
        2,
        ["rollout=async", *LONG_SAMPLING],
        1,
        [1],
    ),
}


@pytest.mark.parametrize("phase", list(PHASES))
def test_a_stop_in_each_phase_exits_75_within_the_bound_with_the_last_trained_step_saved(tmp_path, phase):
    target, nth, extra, saved, logged = PHASES[phase]
    stopped = stop_in_phase(tmp_path, target, nth, [*BASE, *extra])
    assert_stopped_in(stopped, tmp_path / "run", saved=saved, logged=logged)


def test_a_stop_while_a_slow_reward_runs_cancels_it(tmp_path):
    """The second step's second completion takes a minute to score; the pool abandons it on the stop."""
    env = {
        "GRPO_RUN_TEST_SLOW_AT": "10",  # 8 completions a step: call 10 is in step 2
        "GRPO_RUN_TEST_SLOW_COUNTER": str(tmp_path / "calls"),
        "GRPO_RUN_TEST_SLOW_MARKER": str(tmp_path / "phase.started"),
    }
    stopped = stop_in_phase(tmp_path, "-", 0, [*BASE, *SLOW_REWARD], env)
    assert_stopped_in(stopped, tmp_path / "run", saved=1, logged=[1])


# ------------------------------------------------------------------------------- resume after the stop

RESUMED = [*BASE, *SLOW_REWARD, *SMALL_EVAL]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    """RESUMED in one go (trained in this process: the baseline, not a run under test)."""
    return run_here(RESUMED, tmp_path_factory.mktemp("uninterrupted") / "run")


@pytest.mark.parametrize(
    "target, nth",
    [("grpo_run.trainer:policy_update", 2), ("grpo_run.trainer:evaluate_run", 2)],
    ids=["update", "evaluation"],
)
def test_the_resumed_run_equals_the_uninterrupted_one(tmp_path, uninterrupted, target, nth):
    """Stopped in step 2's update (step 1 saved) or in step 2's evaluation (step 2 saved, unlogged):
    resume=auto trains and logs every step and every due evaluation exactly once, as one run does."""
    run_dir = tmp_path / "run"
    stopped = stop_in_phase(tmp_path, target, nth, RESUMED)
    assert stopped.code == EXIT_PREEMPTED, stopped.err
    run_here([*RESUMED, "resume=auto"], run_dir)  # in this process: what the stop left is under test
    rows, reference = read_metrics(run_dir), read_metrics(uninterrupted)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert without_timings(rows) == without_timings(reference)
    ours = load_file(run_dir / "final" / "model.safetensors")
    theirs = load_file(uninterrupted / "final" / "model.safetensors")
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
