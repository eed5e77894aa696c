"""`grpo-run-report <multirun dir>`: one table row per job and a PNG of reward-mean and KL curves (at β = 0:
held-out accuracy, held-out reward, entropy or clip fraction, whichever the jobs logged), and, for jobs that trained against
a reward model or a judge, its score beside the held-out accuracy; for a
seed sweep also one row per configuration with its gain ± a t-interval over seeds (tracking/seeds.py).

Reads only what each job left in its run dir (metrics.jsonl, .hydra/overrides.yaml and the resolved
config), so it works offline, without W&B, also on a sweep that is still running. Runs that logged
per-bucket held-out metrics (eval.group_by) also get buckets.png: one panel per bucket
(tracking/bucket_curves.py).
"""

import argparse
import math
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from grpo_run import metrics as M
from grpo_run.tracking import seeds
from grpo_run.tracking.bucket_curves import BUCKETS_PNG, plot_buckets
from grpo_run.tracking.sweep_jobs import Job, load_sweep

PNG_NAME = "report.png"
REWARD_PANEL = (M.REWARD_MEAN, "reward mean")
# The second panel: KL when some job logged it (beta > 0), else the first of these that a job logged, so a
# sweep at beta = 0 (the default) never gets an empty panel.
SECOND_PANELS = [
    (M.KL, "KL (k3)"),
    (M.EVAL_ACCURACY, "held-out accuracy"),
    (M.EVAL_REWARD_MEAN, "held-out reward (eval.reward)"),
    (M.ENTROPY, "entropy"),
    (M.CLIP_FRACTION, "clip fraction"),
]


def _fmt(value: float | None, digits: int = 4) -> str:
    if value is None:
        return "–"
    return str(value) if not math.isfinite(value) else f"{value:.{digits}f}"


def build_table(jobs: list[Job]) -> Table:
    with_eval = any(j.final(M.EVAL_ACCURACY) is not None for j in jobs)
    # A run with its own reward (eval.reward) logs a held-out reward, and without gold answers no accuracy.
    with_eval_reward = any(j.final(M.EVAL_REWARD_MEAN) is not None for j in jobs)
    table = Table(title=f"{len(jobs)} jobs")
    columns = ["job", "β", "ε", "G", "steps", "reward mean", "KL", "clip frac", "zero-std frac"]
    columns += ["eval acc"] if with_eval else []
    columns += ["eval reward"] if with_eval_reward else []
    columns += ["steps/s"]
    for name in columns:
        table.add_column(name, justify="left" if name == "job" else "right")
    for job in jobs:
        cells = [
            job.label,
            f"{job.beta:g}",
            f"{job.epsilon:g}",
            str(job.group_size),
            str(job.last_step()),
            _fmt(job.final(M.REWARD_MEAN)),
            _fmt(job.final(M.KL)),
            _fmt(job.final(M.CLIP_FRACTION)),
            _fmt(job.final(M.FRAC_REWARD_ZERO_STD), 2),
        ]
        cells += [_fmt(job.final(M.EVAL_ACCURACY), 3)] if with_eval else []
        cells += [_fmt(job.final(M.EVAL_REWARD_MEAN), 3)] if with_eval_reward else []
        cells += [_fmt(job.steps_per_s(), 2)]
        table.add_row(*cells)
    return table


def curve_panels(jobs: list[Job]) -> list[tuple[str, str]]:
    """(key, title) of the two panels: reward mean, and KL or the first other key some job logged."""
    logged = [p for p in SECOND_PANELS if any(job.series(p[0])[0] for job in jobs)]
    return [REWARD_PANEL, logged[0] if logged else SECOND_PANELS[0]]


def proxy_series(job: Job) -> list[tuple[str, tuple[list[int], list[float]]]]:
    """(name, its train/rewards/<name>_mean over steps) of each reward model or judge the job trained
    against that it logged, when it also logged a held-out accuracy to hold them against."""
    if not job.series(M.EVAL_ACCURACY)[0]:
        return []
    found = [(name, job.series(M.REWARD_FN_MEAN.format(name))) for name in job.model_rewards]
    return [(name, series) for name, series in found if series[0]]


def draw_proxy_panel(ax, jobs: list[Job]) -> None:
    """The proxy and the truth on the same steps: each model reward's mean score (solid, left axis: a
    classifier's logit has a scale of its own) and the held-out greedy accuracy (dashed, right axis), one
    colour per job, so a user sees whether, and from when, the proxy rises while the truth does not."""
    truth = ax.twinx()
    for i, job in enumerate(jobs):
        series = proxy_series(job)
        for name, (steps, values) in series:
            ax.plot(steps, values, color=f"C{i % 10}", label=f"{job.label}: {name}")
        if series:
            steps, values = job.series(M.EVAL_ACCURACY)
            truth.plot(steps, values, color=f"C{i % 10}", linestyle="--", marker="o")
    ax.set_title("reward model (solid) against held-out accuracy (dashed)")
    ax.set_xlabel("step")
    ax.set_ylabel("model reward mean")
    truth.set_ylabel("held-out accuracy")
    ax.grid(alpha=0.3)


def plot_curves(jobs: list[Job], png: Path) -> Path:
    """Reward mean and KL (or what the jobs logged instead) against the step, one line per job."""
    import matplotlib.pyplot as plt

    fig = curves_figure(jobs)
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return png


def curves_figure(jobs: list[Job]):
    """The figure `plot_curves` saves: one axes per `curve_panels` entry."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a cluster or in CI
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    panels = curve_panels(jobs)
    with_proxy = any(proxy_series(job) for job in jobs)
    columns = len(panels) + with_proxy
    fig, axes = plt.subplots(1, columns, figsize=(6 * columns, 4), squeeze=False)
    for ax, (key, title) in zip(axes[0], panels):
        for i, job in enumerate(jobs):
            steps, values = job.series(key)
            # One colour per job in both panels, also when a job lacks the key (KL at beta = 0).
            marker = "." if len(steps) < 20 else None
            ax.plot(steps, values, color=f"C{i % 10}", marker=marker, label=job.label)
        ax.set_title(title)
        ax.set_xlabel("step")
        if any(job.series(key)[0] for job in jobs):
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.grid(alpha=0.3)
        else:  # no job logged any of the keys: say so instead of drawing empty axes
            ax.text(0.5, 0.5, f"no job logged {key}", ha="center", va="center", transform=ax.transAxes)
            ax.set_xticks([])
            ax.set_yticks([])
    if with_proxy:
        draw_proxy_panel(axes[0][-1], jobs)
    handles, labels = axes[0][0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="lower center", ncol=min(4, len(labels)), fontsize="small")
    fig.tight_layout(rect=(0, 0.08 + 0.04 * (len(labels) // 4), 1, 1))
    return fig


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="grpo-run-report", description=__doc__.splitlines()[0])
    parser.add_argument("sweep_dir", type=Path, help="a multirun dir, e.g. outputs/multirun/<date>/<time>")
    parser.add_argument(
        "--png", type=Path, default=None, help=f"where to write the plot (default: DIR/{PNG_NAME})"
    )
    parser.add_argument(
        "--metric",
        default=None,
        help="the held-out key a seed sweep compares (default: eval/accuracy, or eval/reward_mean where no "
        "job logged an accuracy; e.g. eval/gsm8k/accuracy)",
    )
    args = parser.parse_args(argv)
    # Piped (CI logs, `| less`): wide enough that the job labels are never cut.
    console = Console(width=None if sys.stdout.isatty() else 200)
    jobs = load_sweep(args.sweep_dir)
    if not jobs:
        console.print(f"[red]no job with a metrics.jsonl under {args.sweep_dir}")
        return 1
    console.print(build_table(jobs))
    png = plot_curves(jobs, args.png or args.sweep_dir / PNG_NAME)
    console.print(f"curves: {png}")
    by_bucket = plot_buckets(jobs, png.parent / BUCKETS_PNG)  # eval.group_by's per-bucket curves
    if by_bucket is not None:
        console.print(f"per bucket: {by_bucket}")
    key = args.metric or seeds.held_out_key(jobs)
    report_seeds(console, jobs, args.sweep_dir if args.png is None else args.png.parent, key)
    return 0


def report_seeds(console: Console, jobs: list[Job], out_dir: Path, key: str) -> None:
    """A sweep with some configuration on several seeds: the per-configuration table, the pairs these
    seeds cannot tell apart, and the two PNGs."""
    if not seeds.is_seed_sweep(jobs):
        return
    groups = seeds.group_jobs(jobs)
    console.print(seeds.build_seed_table(groups, key))
    for a, b in seeds.overlapping_pairs(groups, key):
        console.print(
            f"[yellow]not distinguishable with these seeds:[/] {a.label} vs {b.label} (intervals overlap)"
        )
    if not any(g.gains(key) for g in groups):
        console.print(f"[yellow]no job has {key} at two steps: evaluate before and after (eval.every_steps)")
    curves = seeds.plot_seed_curves(groups, out_dir / seeds.CURVES_PNG, key)
    bars = seeds.plot_gain_bars(groups, out_dir / seeds.GAIN_PNG, key)
    console.print(f"seed curves: {curves}\nheld-out gain: {bars}")


def cli() -> None:
    raise SystemExit(main())
