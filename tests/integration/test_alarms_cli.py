"""Each in-flight alarm fires on a tiny run built to trigger it, and none on a tiny run that learns."""

import math

import pytest

import grpo_run.trainer as trainer
import grpo_run.update as update
from grpo_run import metrics as M
from tests.builders import QUIET, config
from tests.helpers import FAST, read_metrics, run_cli, stand_in
from tests.wandb_reader import read_records, run_files


def series(rows, key):
    return [r[key] for r in rows]


def test_cut_completions_and_a_constant_zero_reward_fire_once_with_their_remedy(tmp_path):
    """max_new_tokens=1 cuts every completion; reward=format (a non-empty boxed answer) is 0 for the random
    tiny model in every group: truncated from step 3, no signal (all wrong) from step 5. W&B gets both."""
    args = [*FAST, "reward=format", "generation.max_new_tokens=1", "trainer.max_steps=5", "logger=wandb"]
    proc, run_dir = run_cli(args, tmp_path)
    rows = read_metrics(run_dir)
    assert series(rows, M.ALERT_TRUNCATED) == [0, 0, 1, 1, 1]
    assert series(rows, M.ALERT_ALL_WRONG) == [0, 0, 0, 0, 1]
    quiet = [M.ALERT_ALL_CORRECT, M.ALERT_NO_SIGNAL, M.ALERT_REWARD_FAILURES, M.ALERT_KL, M.ALERT_NONFINITE]
    assert all(r[k] == 0 for r in rows for k in quiet)
    assert proc.stderr.count("alerts/truncated") == 1 and "max_new_tokens=1" in proc.stderr
    assert proc.stderr.count("alerts/no_signal_all_wrong") == 1 and "too hard" in proc.stderr
    (files,) = [run_files(run_dir)]
    alerts = [r.alert for r in read_records(files[0]) if r.WhichOneof("record_type") == "alert"]
    assert sorted(a.title.split()[1] for a in alerts) == ["alerts/no_signal_all_wrong", "alerts/truncated"]
    assert all(a.level == "WARN" for a in alerts)


def test_kl_above_the_threshold_fires(tmp_path):
    args = [*FAST, "grpo.beta=0.04", "trainer.lr=1e-2", "alerts.kl_max=1e-6", "trainer.max_steps=3"]
    proc, run_dir = run_cli([*args, "logger=console"], tmp_path)
    rows = read_metrics(run_dir)
    assert rows[0][M.KL] == 0 and rows[0][M.ALERT_KL] == 0  # step 1: the policy is the reference
    assert all(r[M.ALERT_KL] == 1 for r in rows[1:]) and rows[1][M.KL] > 1e-6
    assert proc.stderr.count("alerts/kl") == 1 and "alerts.kl_max=1e-06" in proc.stderr


def always_raises(prompts, completions, answers, **kwargs):
    raise ValueError("broken reward")


def test_a_reward_that_raises_fires_reward_failures(tmp_path, monkeypatch, capsys):
    stand_in(monkeypatch, "target_char_fraction", always_raises)
    run_dir = tmp_path / "run"
    trainer.train(config([*FAST, *QUIET], run_dir))
    rows = read_metrics(run_dir)
    assert series(rows, M.REWARD_ERRORS) == [8, 8]
    assert series(rows, M.ALERT_REWARD_FAILURES) == [1, 1]
    err = capsys.readouterr().err
    assert err.count("alerts/reward_failures") == 1 and "100% of this step's completions" in err


def nan_loss_from_step(monkeypatch, first: int) -> None:
    """Add NaN to the policy loss from step `first` on: every later update is skipped."""
    current = {"step": 0}
    real_step, real_loss = trainer.train_step, update.policy_loss

    def train_step(ctx, state, step):
        current["step"] = step
        return real_step(ctx, state, step)

    def policy_loss(*args, **kwargs):
        out = real_loss(*args, **kwargs)
        return out._replace(loss=out.loss + float("nan")) if current["step"] >= first else out

    monkeypatch.setattr(trainer, "train_step", train_step)
    monkeypatch.setattr(update, "policy_loss", policy_loss)


def test_non_finite_updates_warn_before_the_run_stops(tmp_path, monkeypatch, capsys):
    nan_loss_from_step(monkeypatch, 2)
    run_dir = tmp_path / "run"
    overrides = [
        *FAST,
        *QUIET,
        "trainer.lr=3e-3",
        "trainer.max_steps=6",
        "trainer.max_consecutive_nonfinite=3",
    ]
    with pytest.raises(trainer.NonFiniteError):
        trainer.train(config(overrides, run_dir))
    rows = read_metrics(run_dir)
    # Said at step 2; step 4 is the third skipped update in a row, logged, then the run stops.
    assert series(rows, M.ALERT_NONFINITE) == [0, 1, 1, 1]
    assert math.isfinite(rows[0][M.GRAD_NORM])
    err = capsys.readouterr().err
    assert err.count("alerts/nonfinite") == 1 and "trainer.max_consecutive_nonfinite=3" in err


def test_silent_on_a_tiny_run_that_learns(tmp_path):
    """Reward = share of 'a' characters; 256 new tokens, so most completions end with EOS."""
    args = [
        "model=tiny",
        "reward=target_char",
        "trainer.max_steps=10",
        "trainer.lr=3e-3",
        "trainer.prompts_per_step=4",
        "grpo.group_size=8",
        "trainer.micro_batch_size=16",
        "generation.max_new_tokens=256",
        "trainer.seed=0",
        "trainer.device=cpu",
        "logger=console",
        "eval.every_steps=0",
    ]
    proc, run_dir = run_cli(args, tmp_path)
    rows = read_metrics(run_dir)
    assert all(r[k] == 0 for r in rows for k in M.ALERT_KEYS)
    assert "alert" not in proc.stderr
    # It does learn: measured with this seed, ~0.055 over the first three steps, ~0.08 over the last three.
    first = sum(r[M.REWARD_MEAN] for r in rows[:3]) / 3
    last = sum(r[M.REWARD_MEAN] for r in rows[-3:]) / 3
    assert last > first + 0.01, (first, last)
