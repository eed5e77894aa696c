"""sweep=seeds through the real CLI on the tiny model: 2 configurations x 2 seeds, held-out intervals in
metrics.jsonl, the paired summary, and a report that groups the 4 jobs into 2 rows of n = 2; eval.datasets."""

import json
import subprocess
import sys
from pathlib import Path

from grpo_run import metrics as M
from grpo_run.evaluation.stats import read_problems
from grpo_run.tracking import seeds
from grpo_run.tracking.report import load_sweep
from tests.helpers import FAST, read_metrics, run_cli

REPORT = str(Path(sys.executable).parent / "grpo-run-report")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# Evaluate at step 0 and after the last step (2) on 8 held-out arithmetic problems, k = 2.
EVAL = [
    "eval.every_steps=2",
    "eval.num_prompts=8",
    "eval.samples_per_prompt=2",
    "eval.max_new_tokens=6",
    "eval.batch_size=8",
    "data.eval_size=8",
    "data.train_size=64",
]
TINY = (
    [a for a in FAST if not a.startswith("eval.every_steps")]
    + EVAL
    + ["logger=console", "logger.console=false"]
)


def test_seed_sweep_report_groups_four_jobs_into_two_rows(tmp_path):
    sweep = tmp_path / "sweep"
    args = [
        "-m",
        "sweep=seeds",
        "trainer.seed=0,1",
        "grpo.epsilon=0.1,0.2",
        *TINY,
        f"hydra.sweep.dir={sweep}",
    ]
    run_cli(args, tmp_path, timeout=300)
    jobs = load_sweep(sweep)
    assert len(jobs) == 4
    for job in jobs:
        rows = read_metrics(job.path)
        evals = [r for r in rows if M.EVAL_ACCURACY in r]
        assert [r["step"] for r in evals] == [0, 2]
        for r in evals:  # every rate with its interval, and pass@k beside mean@k
            for key in M.EVAL_RATES:
                assert r[key + M.CI_LOW] <= r[key] <= r[key + M.CI_HIGH], key
            assert r[M.EVAL_NUM_PROBLEMS] == 8
        assert (
            set(read_problems(job.path, 0)) == {"default"}
            and len(read_problems(job.path, 2)["default"].ids) == 8
        )
        change = json.loads((job.path / "eval_summary.json").read_text())["change"]
        assert change[M.EVAL_ACCURACY_FLIPS_UP] + change[M.EVAL_ACCURACY_FLIPS_DOWN] <= 8
        assert change[M.EVAL_ACCURACY_CI_LOW] <= change[M.EVAL_ACCURACY] <= change[M.EVAL_ACCURACY_CI_HIGH]

    groups = seeds.group_jobs(jobs)
    assert [g.label for g in groups] == ["epsilon=0.1", "epsilon=0.2"]
    assert [len(g.gains(M.EVAL_ACCURACY)) for g in groups] == [2, 2]
    assert [sorted(g.seeds()) for g in groups] == [["0", "1"], ["0", "1"]]

    report = subprocess.run([REPORT, str(sweep)], capture_output=True, text=True, timeout=120)
    assert report.returncode == 0, report.stderr
    assert "2 configurations, 4 jobs" in report.stdout
    lines = [line for line in report.stdout.splitlines() if line.startswith("│ epsilon=")]
    assert len(lines) == 2 + 4  # the per-job table's 4 rows, the seed table's 2
    seed_rows = [line for line in lines if ",seed=" not in line]
    assert len(seed_rows) == 2 and all(line.split("│")[2].strip() == "2" for line in seed_rows)  # n = 2
    for name in (seeds.CURVES_PNG, seeds.GAIN_PNG):
        png = sweep / name
        assert png.read_bytes().startswith(PNG_MAGIC) and png.stat().st_size > 10_000


def test_eval_datasets_log_each_set_under_its_own_prefix(tmp_path):
    extra = [
        "+data@eval.datasets.three=arithmetic",
        "eval.datasets.three.arithmetic.num_operands=3",
        "eval.datasets.three.eval_size=4",
    ]
    _, run_dir = run_cli([*TINY, *extra], tmp_path, timeout=300)
    rows = [r for r in read_metrics(run_dir) if M.EVAL_ACCURACY in r]
    assert [r["step"] for r in rows] == [0, 2]
    for r in rows:
        assert r[M.EVAL_NUM_PROBLEMS] == 8 and r["eval/three/num_problems"] == 4
        assert r["eval/three/accuracy_ci_low"] <= r["eval/three/accuracy"] <= r["eval/three/accuracy_ci_high"]
        assert "eval/three/pass_at_k" in r and M.EVAL_S in r and "perf/eval/three_s" not in r
    problems = read_problems(run_dir, 2)
    assert set(problems) == {"default", "three"} and len(problems["three"].ids) == 4
    summary = json.loads((run_dir / "eval_summary.json").read_text())
    assert summary["num_prompts"] == 8 and summary["datasets"]["three"]["num_prompts"] == 4
    three = summary["datasets"]["three"]
    assert set(three) == {"num_prompts", "step 0", "step 2", "change"}
    assert "eval/three/accuracy_flips_up" in three["change"] and M.EVAL_ACCURACY not in three["step 2"]
    assert "eval/three/accuracy" not in summary["step 2"]  # the default set's column holds only its own keys

    # mode=eval on the run's final/ folder: the same sets, the same greedy answers as the step-2 evaluation.
    args = ["mode=eval", f"eval.checkpoint={run_dir}", *TINY, *extra]
    proc, eval_dir = run_cli(args, tmp_path / "eval", timeout=300)
    evaluated = json.loads((eval_dir / "eval_summary.json").read_text())
    assert evaluated["value"][M.EVAL_ACCURACY] == summary["step 2"][M.EVAL_ACCURACY]
    assert (
        evaluated["datasets"]["three"]["value"]["eval/three/accuracy"]
        == three["step 2"]["eval/three/accuracy"]
    )
    assert M.EVAL_ACCURACY_CI_HIGH in evaluated["value"] and "eval/three/accuracy" in proc.stderr
