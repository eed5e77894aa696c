"""Reliability: each test injects a real fault (a kill, a signal, a NaN, a hanging or broken reward, bad
data, a clash of run dirs) into a real run of the tiny model and checks that no work is lost.

Runs go through the real `grpo-run` command where the fault comes from outside (signals, kills, files);
faults inside the process (a NaN loss, a broken reward) are injected with monkeypatch into `train`.
"""

import json
import math
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import grpo_run.trainer as trainer
from grpo_run import checkpoint
from grpo_run import metrics as M
from grpo_run.safety.signals import EXIT_PREEMPTED
from tests.builders import LEARN, QUIET, config, inject_nan_loss, run_here
from tests.helpers import FAST, GRPO_RUN, REPO, read_metrics, run_cli, stand_in
from tests.integration.hanging_reward import HANG_S, hangs_on_last_call

# No console, no W&B, no held-out evaluation: only what these tests look at.


def without_timings(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if not k.startswith("perf/")} for row in rows]


def weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(folder / "model.safetensors")


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def ckpt(run_dir: Path, step: int) -> Path:
    return run_dir / checkpoint.CHECKPOINTS / checkpoint.step_name(step)


def latest(run_dir: Path) -> str:
    return (run_dir / checkpoint.CHECKPOINTS / checkpoint.LATEST).read_text().strip()


# ------------------------------------------------------------------------------------------- resume


def test_stop_and_resume_through_the_cli_is_bitwise_identical(tmp_path):
    """N = 4 steps in one go vs 2 steps, stop, `resume=auto` in the same run dir for the last 2."""
    args = [*LEARN, "aggregation=per_token", "grpo.num_iterations=2"]
    whole = run_here([*args, "trainer.max_steps=4"], tmp_path / "whole")  # the baseline, in this process
    _, split = run_cli([*args, "trainer.max_steps=2"], tmp_path / "split")
    assert latest(split) == checkpoint.step_name(2)  # save_final: a checkpoint after the last step
    proc, split = run_cli([*args, "trainer.max_steps=4", "resume=auto"], tmp_path / "split")
    assert "resumed from" in proc.stderr and "(step 2)" in proc.stderr

    assert [r["step"] for r in read_metrics(split)] == [1, 2, 3, 4]
    assert without_timings(read_metrics(split)) == without_timings(read_metrics(whole))
    assert_same_weights(weights(whole / "final"), weights(split / "final"))
    assert_same_weights(weights(ckpt(whole, 4)), weights(ckpt(split, 4)))


def test_a_resumed_run_still_reports_its_step_0_evaluation(tmp_path):
    """The final summary compares against step 0 even when step 0 ran in an earlier process."""
    args = [*FAST, "logger=console", "logger.console=false", "eval.every_steps=4", "eval.num_prompts=3"]
    args += ["eval.samples_per_prompt=2", "eval.max_new_tokens=4"]
    run_dir = tmp_path / "run"
    trainer.train(config([*args, "trainer.max_steps=2"], run_dir))  # evaluates at steps 0 and 2
    trainer.train(config([*args, "trainer.max_steps=4", "resume=auto"], run_dir))
    summary = json.loads((run_dir / "eval_summary.json").read_text())
    assert list(summary) == ["num_prompts", "k", "step 0", "step 4", "change"]
    step0 = next(r for r in read_metrics(run_dir) if r["step"] == 0)
    assert summary["step 0"]["eval/accuracy"] == step0["eval/accuracy"]
    assert (
        summary["change"]["eval/mean_at_k"] == summary["step 4"]["eval/mean_at_k"] - step0["eval/mean_at_k"]
    )
    # the change is paired with the step-0 problems that the first process wrote (eval_problems/step_0.json)
    flips = summary["change"]["eval/accuracy_flips_up"] + summary["change"]["eval/accuracy_flips_down"]
    assert summary["change"]["eval/num_problems"] == 3 and 0 <= flips <= 3


@pytest.mark.parametrize(
    "aggregation,mu,extra",
    [
        ("per_response", 1, []),
        ("per_response", 2, []),
        ("per_token", 1, []),
        ("per_token", 2, []),
        ("per_response", 1, ["kl_control=adaptive"]),  # beta itself changes every step: checkpointed
        # the entropy bonus's coefficient and the entropy it reacts to (a target above any entropy
        # the tiny model reaches: the coefficient grows every step)
        ("per_response", 1, ["grpo.entropy_control=adaptive", "grpo.entropy_target=100"]),
    ],
)
def test_resume_from_a_middle_checkpoint_is_bitwise_identical(tmp_path, aggregation, mu, extra):
    """In process, both aggregations and mu = 1, 2: the resumed run repeats steps 3-4 bit for bit."""
    args = [*LEARN, f"aggregation={aggregation}", f"grpo.num_iterations={mu}", "trainer.max_steps=4", *extra]
    whole = tmp_path / "whole"
    trainer.train(config([*args, "checkpoint.every_steps=1", "checkpoint.keep_last=4"], whole))
    resumed = tmp_path / "resumed"
    trainer.train(config([*args, f"resume={ckpt(whole, 2)}"], resumed))

    assert [r["step"] for r in read_metrics(resumed)] == [3, 4]
    assert without_timings(read_metrics(resumed)) == without_timings(read_metrics(whole))[2:]
    assert_same_weights(weights(whole / "final"), weights(resumed / "final"))
    adam_whole = torch.load(ckpt(whole, 4) / "optimizer.pt", weights_only=True)
    adam_resumed = torch.load(ckpt(resumed, 4) / "optimizer.pt", weights_only=True)
    for i, state in adam_whole["state"].items():
        for key, value in state.items():
            assert torch.equal(value, adam_resumed["state"][i][key]), (i, key)


# ------------------------------------------------------------------------------------ kills and signals

KILL_DRIVER = textwrap.dedent(
    """
    # Dies by SIGKILL in the middle of writing the checkpoint of step {kill_step}: the engine's files are
    # on disk, the RNG states and trainer_state.json are not.
    import os, signal, sys
    from grpo_run import checkpoint
    from grpo_run.cli import main

    # The save's own module looks rng_state up (the package re-exports it, and checkpoint.save is the function).
    save_module = sys.modules["grpo_run.checkpoint.save"]
    real_save, real_rng_state = checkpoint.save, save_module.rng_state
    saves = []

    def counting_save(*args, **kwargs):
        saves.append(1)
        return real_save(*args, **kwargs)

    def rng_state_then_die():
        # Called by the save, after the engine's files are written.
        if len(saves) == {kill_step}:
            os.kill(os.getpid(), signal.SIGKILL)
        return real_rng_state()

    checkpoint.save, save_module.rng_state = counting_save, rng_state_then_die
    sys.argv = ["grpo-run", *sys.argv[1:]]
    main()
    """
)


def test_sigkill_during_a_checkpoint_write_leaves_the_previous_one_latest(tmp_path):
    run_dir = tmp_path / "run"
    driver = tmp_path / "driver.py"
    driver.write_text(KILL_DRIVER.format(kill_step=3))
    args = [*FAST, *QUIET, "trainer.lr=3e-3", "trainer.max_steps=4", "checkpoint.every_steps=1"]
    killed = subprocess.run(
        [sys.executable, str(driver), *args, f"hydra.run.dir={run_dir}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    root = run_dir / checkpoint.CHECKPOINTS
    unfinished = root / f"{checkpoint.TMP_PREFIX}{checkpoint.step_name(3)}"
    assert (unfinished / "model.safetensors").exists()  # killed mid-write, not before it
    assert not (unfinished / checkpoint.STATE_FILE).exists()
    assert latest(run_dir) == checkpoint.step_name(2)
    step3_before = read_metrics(run_dir)[-1]
    assert step3_before["step"] == 3  # logged, but never checkpointed

    proc, _ = run_cli([*args, "resume=auto"], tmp_path)
    assert f"resumed from {ckpt(run_dir, 2)} (step 2)" in proc.stderr.replace("\n", "")
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]  # step 3 trained again, logged once
    assert without_timings([rows[2]]) == without_timings([step3_before])
    assert not unfinished.exists()  # the next save cleaned it up
    assert latest(run_dir) == checkpoint.step_name(4)


def start_until_step(args: list[str], run_dir: Path, steps: int, env=None) -> subprocess.Popen:
    proc = subprocess.Popen(
        [GRPO_RUN, *args, f"hydra.run.dir={run_dir}"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    )
    metrics = run_dir / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and not (metrics.exists() and metrics.read_text().count("\n") >= steps):
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.1)
    return proc


def test_sigterm_saves_exits_75_and_resume_continues_from_that_step(tmp_path):
    run_dir = tmp_path / "run"
    args = [*FAST, *QUIET, "trainer.max_steps=100000"]
    proc = start_until_step(args, run_dir, steps=2)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)  # a second signal while stopping is ignored, not fatal
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_PREEMPTED, err
    assert "SIGTERM" in err and "resume=auto" in err
    stopped_at = read_metrics(run_dir)[-1]["step"]
    assert stopped_at >= 2 and latest(run_dir) == checkpoint.step_name(stopped_at)
    assert checkpoint.read_state(ckpt(run_dir, stopped_at)).step == stopped_at

    proc, _ = run_cli([*args[:-1], f"trainer.max_steps={stopped_at + 2}", "resume=auto"], tmp_path)
    assert f"(step {stopped_at})" in proc.stderr
    assert [r["step"] for r in read_metrics(run_dir)] == list(range(1, stopped_at + 3))


def test_sigusr1_under_slurm_saves_and_requeues_the_job(tmp_path):
    """A stand-in `scontrol` on PATH records how it was called (no Slurm on a CI machine)."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "scontrol_calls"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> {calls}\n')
    (bin_dir / "scontrol").chmod(0o755)
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "4242"}
    run_dir = tmp_path / "run"
    proc = start_until_step([*FAST, *QUIET, "trainer.max_steps=100000"], run_dir, steps=1, env=env)
    proc.send_signal(signal.SIGUSR1)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_PREEMPTED, err
    assert calls.read_text().split() == ["requeue", "4242"]
    assert latest(run_dir) == checkpoint.step_name(read_metrics(run_dir)[-1]["step"])


# -------------------------------------------------------------------------------------- numerical faults


def test_a_nan_loss_skips_the_update_and_counts_it(tmp_path, monkeypatch):
    inject_nan_loss(monkeypatch, lambda step: step == 2)
    run_dir = tmp_path / "run"
    overrides = [*LEARN, "trainer.max_steps=3", "checkpoint.every_steps=1", "checkpoint.keep_last=3"]
    trainer.train(config(overrides, run_dir))
    rows = read_metrics(run_dir)
    assert [r[M.SKIPPED_STEPS] for r in rows] == [0.0, 1.0, 0.0]
    assert rows[1][M.LOSS] == "nan" and math.isfinite(rows[2][M.LOSS])
    # The skipped update changed nothing: weights and Adam state after step 2 are those after step 1.
    assert_same_weights(weights(ckpt(run_dir, 1)), weights(ckpt(run_dir, 2)))
    adam1 = torch.load(ckpt(run_dir, 1) / "optimizer.pt", weights_only=True)
    adam2 = torch.load(ckpt(run_dir, 2) / "optimizer.pt", weights_only=True)
    assert all(
        torch.equal(adam1["state"][i]["exp_avg"], adam2["state"][i]["exp_avg"]) for i in adam1["state"]
    )
    assert not torch.equal(
        weights(ckpt(run_dir, 2))["lm_head.weight"], weights(ckpt(run_dir, 3))["lm_head.weight"]
    )
    assert [checkpoint.read_state(ckpt(run_dir, s)).nonfinite_streak for s in (1, 2, 3)] == [0, 1, 0]


def test_repeated_nan_losses_stop_the_run_naming_the_step(tmp_path, monkeypatch):
    inject_nan_loss(monkeypatch, lambda step: step >= 2)
    run_dir = tmp_path / "run"
    overrides = [
        *LEARN,
        "trainer.max_steps=6",
        "checkpoint.every_steps=1",
        "trainer.max_consecutive_nonfinite=2",
    ]
    with pytest.raises(trainer.NonFiniteError, match=r"step 3: 2 optimizer updates in a row"):
        trainer.train(config(overrides, run_dir))
    assert latest(run_dir) == checkpoint.step_name(2)  # step 3 was not saved; every saved weight is finite
    for tensor in weights(ckpt(run_dir, 2)).values():
        assert torch.isfinite(tensor).all()


# ----------------------------------------------------------------------------------------- reward faults


def test_a_hanging_verifier_returns_within_its_budget_as_a_timeout(tmp_path, monkeypatch):
    """The step's last of 8 verifications sleeps 30 s; its 2 s budget cuts it short and counts a timeout."""
    monkeypatch.setenv("GRPO_RUN_TEST_HANG_COUNTER", str(tmp_path / "calls"))
    monkeypatch.setenv("GRPO_RUN_TEST_HANG_AT", "8")
    stand_in(monkeypatch, "math_verifier", hangs_on_last_call)
    run_dir = tmp_path / "run"
    overrides = [*FAST, *QUIET, "reward=math_verifier", "reward.timeout_s=2", "trainer.max_steps=1"]
    started = time.perf_counter()
    trainer.train(config(overrides, run_dir))
    elapsed = time.perf_counter() - started
    (row,) = read_metrics(run_dir)
    assert (tmp_path / "calls").read_text() == "8"
    assert row[M.REWARD_TIMEOUTS] == 1 and row[M.REWARD_ERRORS] == 0  # a timeout, not a wrong answer
    # Worker start-up + 7 quick calls + the 2 s budget; the whole run ends before the sleep would have.
    assert elapsed < HANG_S, elapsed


def odd_length_raises(prompts, completions, answers, **kwargs):
    if any(len(c) % 2 for c in completions):
        raise ValueError("odd length")
    return [1.0] * len(completions)


def test_a_reward_that_raises_scores_zero_counts_and_the_run_goes_on(tmp_path, monkeypatch):
    stand_in(monkeypatch, "target_char_fraction", odd_length_raises)
    run_dir = tmp_path / "run"
    trainer.train(config([*FAST, *QUIET, "trainer.max_steps=3"], run_dir))
    rows = read_metrics(run_dir)
    assert len(rows) == 3 and (run_dir / "final" / "model.safetensors").exists()
    assert sum(r[M.REWARD_ERRORS] for r in rows) > 0
    for r in rows:  # errors score 0, the rest 1: the mean is the share that did not raise
        n = 2 * 4
        assert r[M.REWARD_MEAN] == pytest.approx((n - r[M.REWARD_ERRORS]) / n)


def test_a_reward_of_the_wrong_length_is_counted_and_the_run_goes_on(tmp_path, monkeypatch, capsys):
    stand_in(monkeypatch, "target_char_fraction", lambda p, c, a, **k: [1.0])
    trainer.train(config([*FAST, *QUIET], tmp_path / "run"))
    rows = read_metrics(tmp_path / "run")
    assert len(rows) == 2
    for r in rows:  # all 2 prompts x 4 completions of each step: one value for 8 completions, each an error
        assert r[M.REWARD_ERRORS] == 8 and r["train/rewards/target_char_fraction_errors"] == 8
    captured = capsys.readouterr()
    assert "'target_char_fraction' returned 1 values for 8 completions" in captured.out + captured.err


def test_an_unparseable_gold_is_unscorable_never_rewarded(tmp_path):
    """The real math_verifier (in its worker process): the broken gold's group is unscorable, not 1.0."""
    data = tmp_path / "golds.jsonl"
    records = [{"question": "What is 1 + 1?", "answer": "2"}, {"question": "Broken?", "answer": "\\frac{"}]
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    run_dir = tmp_path / "run"
    trainer.train(
        config([*FAST, *QUIET, "reward=math_verifier", "data=jsonl", f"data.train_path={data}"], run_dir)
    )
    for row in read_metrics(run_dir):
        assert row[M.REWARD_UNSCORABLE] == 4  # the broken gold's whole group (G = 4), every step
        assert row[M.REWARD_ERRORS] == 0 and row[M.REWARD_TIMEOUTS] == 0


# ----------------------------------------------------------------------------------------- bad input


def test_bad_data_lines_are_skipped_and_counted_with_on_bad_record_skip(tmp_path):
    data = tmp_path / "data.jsonl"
    good = [json.dumps({"question": f"{i} + 1?", "answer": str(i + 1)}) for i in range(3)]
    data.write_text(
        "\n".join([good[0], "{not json", good[1], json.dumps({"question": "no answer"}), good[2]])
    )
    # (The default, data.on_bad_record=error, fails naming the line: tests/integration/test_cli_train.py.)
    proc, run_dir = run_cli(
        [*FAST, *QUIET, "data=jsonl", f"data.train_path={data}", "data.on_bad_record=skip"], tmp_path
    )
    log = proc.stdout + proc.stderr
    assert f"{data}: skipped 2 bad record(s); the first: {data}:2" in log
    assert len(read_metrics(run_dir)) == 2


def test_runs_started_together_never_share_a_run_dir(tmp_path):
    """Two runs ask for the same directory name, as on a clock that gave both the same microsecond
    (seen in CI): one gets the name, the other `<name>-1`. A third run uses the default name."""
    same = "hydra.run.dir=${fresh_dir:outputs/runs/same-tick}"
    commands = [[same], [same], []]
    procs = [
        subprocess.Popen(
            [GRPO_RUN, *FAST, *QUIET, "trainer.max_steps=1", *extra],
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for extra in commands
    ]
    for proc in procs:
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
    runs = tmp_path / "outputs" / "runs"
    assert sorted(p.name for p in runs.glob("same-tick*")) == ["same-tick", "same-tick-1"]
    (default,) = [p for p in runs.glob("2*/*") if p.is_dir()]  # outputs/runs/<date>/<HH-MM-SS-ffffff>
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", default.parent.name), default
    assert re.fullmatch(r"\d{2}-\d{2}-\d{2}-\d{6}(-\d+)?", default.name), default
    for run_dir in [runs / "same-tick", runs / "same-tick-1", default]:
        assert [r["step"] for r in read_metrics(run_dir)] == [1]
        assert (run_dir / "checkpoints" / "step_00000001" / "trainer_state.json").exists()
