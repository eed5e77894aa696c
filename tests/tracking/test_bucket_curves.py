"""grpo-run-report's buckets.png: one panel per eval.group_by bucket, pass@1 and the tool-call rate with
their bands, written from a synthetic metrics.jsonl; none for a run without per-bucket keys."""

from pathlib import Path

from matplotlib.image import imread

from grpo_run import metrics as M
from grpo_run.tracking.bucket_curves import BUCKETS_PNG, bucket_names, buckets_figure
from grpo_run.tracking.report import load_sweep, main
from tests.tracking.test_report import rows, write_job


def bucket_row(step: int, rates: dict[str, tuple[float, float]]) -> dict:
    """An evaluation row: per bucket (pass@1, tool_call_rate), each with a +-0.1 band."""
    row: dict = {"step": step, M.EVAL_ACCURACY: 0.5, M.EVAL_S: 1.0}
    for name, (passed, called) in rates.items():
        for template, value in ((M.EVAL_PASS_AT_1_BY, passed), (M.EVAL_TOOL_CALL_RATE_BY, called)):
            key = template.format(name)
            row |= {key: value, key + M.CI_LOW: value - 0.1, key + M.CI_HIGH: value + 0.1}
    return row


def make_run(root: Path) -> Path:
    sweep = root / "sweep"
    evals = [
        bucket_row(0, {"easy": (0.6, 0.3), "hard": (0.1, 0.2), "mid": (0.4, 0.2)}),
        bucket_row(4, {"easy": (0.8, 0.1), "hard": (0.5, 0.9), "mid": (0.5, 0.5)}),
    ]
    write_job(
        sweep / "0", ["model=tiny"], {"beta": 0.0, "epsilon": 0.2, "group_size": 4}, rows([0.1] * 4) + evals
    )
    return sweep


def test_the_report_writes_one_panel_per_bucket(tmp_path):
    sweep = make_run(tmp_path)
    jobs = load_sweep(sweep)
    assert bucket_names(jobs) == ["easy", "hard", "mid"]
    fig, axes = buckets_figure(jobs)
    assert [ax.get_title() for ax in axes] == ["bucket easy", "bucket hard", "bucket mid"]
    hard = axes[1]
    lines = {line.get_label(): line for line in hard.get_lines()}
    assert set(lines) == {"pass@1", "tool call rate"}
    assert list(lines["tool call rate"].get_ydata()) == [0.2, 0.9]
    assert len(hard.collections) == 2  # the two bands
    assert main([str(sweep)]) == 0
    png = sweep / BUCKETS_PNG
    assert imread(png).shape[1] == 3 * 4.5 * 120  # three panels of 4.5 inches at 120 dpi


def test_no_bucket_keys_no_bucket_png(tmp_path):
    sweep = tmp_path / "sweep"
    write_job(sweep / "0", ["model=tiny"], {"beta": 0.0, "epsilon": 0.2, "group_size": 4}, rows([0.1, 0.2]))
    assert buckets_figure(load_sweep(sweep)) is None
    assert main([str(sweep)]) == 0 and not (sweep / BUCKETS_PNG).exists()
