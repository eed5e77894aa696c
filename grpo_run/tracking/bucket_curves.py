"""grpo-run-report's per-bucket PNG: for runs that logged eval.group_by's metrics, one panel per bucket
(difficulty) with held-out pass@1 and the tool-call rate against the step, each with its 95% band, one
colour per job. It shows whether a model learns to call a tool on the hard problems and not on the easy
ones (docs/evaluation.md, "Per-bucket metrics")."""

from pathlib import Path

from grpo_run import metrics as M
from grpo_run.tracking.sweep_jobs import Job

BUCKETS_PNG = "buckets.png"
_PASS = M.EVAL_PASS_AT_1_BY.format("")  # eval/pass@1/<bucket> of the run's own held-out split
# (curve's key template, its legend name, its line style)
_CURVES = ((M.EVAL_PASS_AT_1_BY, "pass@1", "-"), (M.EVAL_TOOL_CALL_RATE_BY, "tool call rate", "--"))


def bucket_names(jobs: list[Job]) -> list[str]:
    """The buckets some job logged eval/pass@1/<bucket> for, sorted."""
    names = {
        key[len(_PASS) :]
        for job in jobs
        for row in job.rows
        for key in row
        if key.startswith(_PASS) and not key.endswith((M.CI_LOW, M.CI_HIGH))
    }
    return sorted(names)


def _band(job: Job, key: str) -> tuple[list[int], list[float], list[float]]:
    rows = [r for r in job.rows if key + M.CI_LOW in r and key + M.CI_HIGH in r]
    return [r["step"] for r in rows], [r[key + M.CI_LOW] for r in rows], [r[key + M.CI_HIGH] for r in rows]


def buckets_figure(jobs: list[Job]):
    """(figure, its axes: one per bucket of `bucket_names`, in that order); None when there is none."""
    names = bucket_names(jobs)
    if not names:
        return None
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a cluster or in CI
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, grid = plt.subplots(1, len(names), figsize=(4.5 * len(names), 4), squeeze=False)
    axes = list(grid[0])
    for ax, name in zip(axes, names):
        for i, job in enumerate(jobs):
            for template, what, style in _CURVES:
                key = template.format(name)
                steps, values = job.series(key)
                if not steps:
                    continue  # no environment: no tool-call rate
                label = what if len(jobs) == 1 else f"{what}: {job.label}"
                ax.plot(steps, values, style, color=f"C{i % 10}", marker=".", label=label)
                band_steps, low, high = _band(job, key)
                ax.fill_between(band_steps, low, high, color=f"C{i % 10}", alpha=0.15, linewidth=0)
        ax.set_title(f"bucket {name}")
        ax.set_xlabel("step")
        ax.set_ylim(-0.02, 1.02)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("held-out rate (95% band)")
    handles, labels = axes[0].get_legend_handles_labels()
    if handles:
        axes[0].legend(handles, labels, fontsize="small", loc="best")
    fig.tight_layout()
    return fig, axes


def plot_buckets(jobs: list[Job], png: Path) -> Path | None:
    """Write `buckets_figure` to `png`; None (nothing written) when no job logged per-bucket metrics."""
    made = buckets_figure(jobs)
    if made is None:
        return None
    import matplotlib.pyplot as plt

    fig, _ = made
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return png
