"""The seed sweep's report (grpo_run/tracking/seeds.py) on hand-written job dirs: grouping, gains,
t-intervals, overlap flags, the PNGs."""

import json
from pathlib import Path

import pytest
import yaml

from grpo_run import metrics as M
from grpo_run.algo.intervals import t_quantile_975
from grpo_run.tracking import seeds
from grpo_run.tracking.report import load_sweep, main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_job(
    job: Path, overrides: list[str], accuracy: tuple[float, float], rewards=(0.1, 0.2), key=M.EVAL_ACCURACY
) -> None:
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    (job / "config_resolved.yaml").write_text(
        yaml.safe_dump({"grpo": {"beta": 0, "epsilon": 0.2, "group_size": 4}})
    )
    rows = [
        {"step": 0, key: accuracy[0]},
        {"step": 1, M.REWARD_MEAN: rewards[0], M.STEP_S: 1.0},
        {"step": 2, M.REWARD_MEAN: rewards[1], M.STEP_S: 1.0, key: accuracy[1]},
    ]
    (job / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def make_sweep(root: Path, key: str = M.EVAL_ACCURACY) -> Path:
    """2 configurations (beta) x 3 seeds, plus a third configuration far above both on 2 seeds; `key`: the
    held-out metric the jobs log."""
    sweep = root / "sweep"
    fixed = ["sweep=seeds", "model=tiny"]
    gains = {"0": [0.10, 0.20, 0.30], "0.04": [0.15, 0.25, 0.20], "0.1": [0.90, 0.92]}
    job = 0
    for beta, values in gains.items():
        for seed, gain in enumerate(values):
            overrides = [*fixed, f"trainer.seed={seed}", f"grpo.beta={beta}"]
            write_job(sweep / str(job), overrides, (0.05, 0.05 + gain), key=key)
            job += 1
    return sweep


def test_jobs_group_by_every_override_but_the_seed(tmp_path):
    groups = seeds.group_jobs(load_sweep(make_sweep(tmp_path)))
    assert [g.label for g in groups] == ["beta=0", "beta=0.04", "beta=0.1"]
    assert [len(g.jobs) for g in groups] == [3, 3, 2]
    assert groups[0].seeds() == ["0", "1", "2"]
    assert groups[0].gains(M.EVAL_ACCURACY) == pytest.approx([0.10, 0.20, 0.30])


def test_gain_interval_is_students_t_over_seeds(tmp_path):
    groups = seeds.group_jobs(load_sweep(make_sweep(tmp_path)))
    # beta=0: gains [0.1, 0.2, 0.3] -> mean 0.2, sd 0.1, se 0.1/sqrt(3) = 0.057735,
    # half = t(0.975, 2) * se = 4.302653 * 0.057735 = 0.248414
    mean, low, high = groups[0].gain_interval(M.EVAL_ACCURACY)
    assert mean == pytest.approx(0.2)
    assert (low, high) == pytest.approx((0.2 - 0.248414, 0.2 + 0.248414), abs=1e-6)
    # beta=0.1: [0.90, 0.92] -> mean 0.91, sd 0.014142, se 0.01, half = 12.706205 * 0.01
    mean, low, high = groups[2].gain_interval(M.EVAL_ACCURACY)
    assert (low, high) == pytest.approx((0.91 - t_quantile_975(1) * 0.01, 0.91 + 0.127062), abs=1e-5)


def test_overlapping_intervals_are_flagged(tmp_path):
    groups = seeds.group_jobs(load_sweep(make_sweep(tmp_path)))
    pairs = [(a.label, b.label) for a, b in seeds.overlapping_pairs(groups)]
    # beta=0 [-0.048, 0.448] and beta=0.04 [0.076, 0.324] overlap; beta=0.1 [0.783, 1.037] is apart from both
    assert pairs == [("beta=0", "beta=0.04")]


def test_a_sweep_on_one_seed_is_no_seed_sweep(tmp_path):
    sweep = tmp_path / "sweep"
    write_job(sweep / "0", ["grpo.beta=0"], (0.1, 0.2))
    write_job(sweep / "1", ["grpo.beta=0.04"], (0.1, 0.3))
    assert not seeds.is_seed_sweep(load_sweep(sweep))


def test_report_prints_the_table_flags_and_writes_the_pngs(tmp_path, capsys):
    sweep = make_sweep(tmp_path)
    assert main([str(sweep)]) == 0
    out = capsys.readouterr().out
    assert "3 configurations, 8 jobs" in out
    assert "not distinguishable with these seeds: beta=0 vs beta=0.04" in out
    assert "beta=0.1 vs" not in out
    assert "0: +0.100  1: +0.200  2: +0.300" in out  # each seed's gain
    for name in (seeds.CURVES_PNG, seeds.GAIN_PNG):
        png = sweep / name
        assert png.read_bytes().startswith(PNG_MAGIC) and png.stat().st_size > 10_000


def test_runs_with_their_own_reward_compare_their_held_out_reward(tmp_path, capsys):
    """Jobs that logged eval/reward_mean and no eval/accuracy (eval.reward, no gold answers): the seed
    report compares eval/reward_mean without being told; an accuracy sweep keeps eval/accuracy."""
    sweep = make_sweep(tmp_path, key=M.EVAL_REWARD_MEAN)
    jobs = load_sweep(sweep)
    assert seeds.held_out_key(jobs) == M.EVAL_REWARD_MEAN
    assert seeds.held_out_key(load_sweep(make_sweep(tmp_path / "acc"))) == M.EVAL_ACCURACY
    assert main([str(sweep)]) == 0
    out = capsys.readouterr().out
    assert f"gain in {M.EVAL_REWARD_MEAN}" in out and "0: +0.100  1: +0.200  2: +0.300" in out
    assert "not distinguishable with these seeds: beta=0 vs beta=0.04" in out
    # --metric still names the key: these jobs have no accuracy at two steps
    assert main([str(sweep), "--metric", M.EVAL_ACCURACY]) == 0
    assert f"no job has {M.EVAL_ACCURACY} at two steps" in capsys.readouterr().out
