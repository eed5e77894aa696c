"""`grpo-run-report <multirun dir>`: one table row per job and a PNG of reward-mean and KL curves; for a
seed sweep also one row per configuration with its gain ± a t-interval over seeds (tracking/seeds.py).

Reads only what each job left in its run dir (metrics.jsonl, .hydra/overrides.yaml and the resolved
config), so it works offline, without W&B, also on a sweep that is still running.
"""

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

from omegaconf import OmegaConf
from rich.console import Console
from rich.table import Table

from grpo_run import metrics as M

PNG_NAME = "report.png"
CURVES = [(M.REWARD_MEAN, "reward mean"), (M.KL, "KL (k3)")]


@dataclass
class Job:
    path: Path
    overrides: list[str]
    beta: float
    epsilon: float
    group_size: int
    rows: list[dict]  # metrics.jsonl, one dict per step
    label: str = ""

    def final(self, key: str) -> float | None:
        """The key's value at the last step that logged it."""
        for row in reversed(self.rows):
            if key in row:
                return float(row[key])  # non-finite values are stored as strings ("nan")
        return None

    def series(self, key: str) -> tuple[list[int], list[float]]:
        points = [(r["step"], float(r[key])) for r in self.rows if key in r]
        return [s for s, _ in points], [v for _, v in points]

    def steps_per_s(self) -> float | None:
        # Training steps only: the step-0 evaluation row has no step time.
        times = [float(r[M.STEP_S]) for r in self.rows if M.STEP_S in r]
        return len(times) / sum(times) if sum(times) > 0 else None

    def last_step(self) -> int:
        return max((int(r["step"]) for r in self.rows), default=0)


def _job_config(job_dir: Path):
    # config_resolved.yaml is grpo-run's own; .hydra/config.yaml is there even if the job failed early.
    resolved = job_dir / "config_resolved.yaml"
    return OmegaConf.load(resolved if resolved.exists() else job_dir / ".hydra" / "config.yaml")


def load_job(job_dir: Path) -> Job:
    overrides_file = job_dir / ".hydra" / "overrides.yaml"
    overrides = [str(o) for o in OmegaConf.load(overrides_file)] if overrides_file.exists() else []
    grpo = _job_config(job_dir).grpo
    lines = (job_dir / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines if line.strip()]
    return Job(job_dir, overrides, float(grpo.beta), float(grpo.epsilon), int(grpo.group_size), rows)


def _job_order(path: Path) -> tuple:
    # Hydra numbers the jobs 0, 1, ..., 10: sort numerically, not as text.
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in path.parts)


def load_sweep(sweep_dir: Path) -> list[Job]:
    """Every job under the sweep dir that has a metrics.jsonl, in job order, labelled by what varies."""
    dirs = sorted((p.parent for p in sweep_dir.rglob("metrics.jsonl")), key=_job_order)
    jobs = [load_job(d) for d in dirs]
    label_jobs(jobs, sweep_dir)
    return jobs


def label_jobs(jobs: list[Job], sweep_dir: Path) -> None:
    """Name each job by the overrides that differ between jobs, sorted by key (as its W&B run name)."""
    values: dict[str, set[str]] = {}
    for job in jobs:
        for o in job.overrides:
            key, _, value = o.partition("=")
            values.setdefault(key, set()).add(value)
    varying = [k for k, v in values.items() if len(v) > 1 or any(k not in _keys(j) for j in jobs)]
    for job in jobs:
        parts = sorted(o for o in job.overrides if o.partition("=")[0] in varying)
        short = [f"{k.split('.')[-1]}={v}" for k, _, v in (p.partition("=") for p in parts)]
        job.label = ",".join(short) or str(job.path.relative_to(sweep_dir))


def _keys(job: Job) -> set[str]:
    return {o.partition("=")[0] for o in job.overrides}


def _fmt(value: float | None, digits: int = 4) -> str:
    if value is None:
        return "–"
    return str(value) if not math.isfinite(value) else f"{value:.{digits}f}"


def build_table(jobs: list[Job]) -> Table:
    with_eval = any(j.final(M.EVAL_ACCURACY) is not None for j in jobs)
    table = Table(title=f"{len(jobs)} jobs")
    columns = ["job", "β", "ε", "G", "steps", "reward mean", "KL", "clip frac", "zero-std frac"]
    columns += ["eval acc"] if with_eval else []
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
        cells += [_fmt(job.steps_per_s(), 2)]
        table.add_row(*cells)
    return table


def plot_curves(jobs: list[Job], png: Path) -> Path:
    """Reward mean and KL against the step, one line per job, side by side."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a cluster or in CI
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(1, len(CURVES), figsize=(6 * len(CURVES), 4), squeeze=False)
    for ax, (key, title) in zip(axes[0], CURVES):
        for i, job in enumerate(jobs):
            steps, values = job.series(key)
            # One colour per job in both panels, also when a job has no KL (beta = 0).
            marker = "." if len(steps) < 20 else None
            ax.plot(steps, values, color=f"C{i % 10}", marker=marker, label=job.label)
        ax.set_title(title)
        ax.set_xlabel("step")
        if any(job.series(key)[0] for job in jobs):
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.grid(alpha=0.3)
        else:  # e.g. KL when every job ran with beta = 0: say so instead of drawing empty axes
            ax.text(0.5, 0.5, f"no job logged {key}", ha="center", va="center", transform=ax.transAxes)
            ax.set_xticks([])
            ax.set_yticks([])
    handles, labels = axes[0][0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="lower center", ncol=min(4, len(labels)), fontsize="small")
    fig.tight_layout(rect=(0, 0.08 + 0.04 * (len(labels) // 4), 1, 1))
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return png


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="grpo-run-report", description=__doc__.splitlines()[0])
    parser.add_argument("sweep_dir", type=Path, help="a multirun dir, e.g. outputs/multirun/<date>/<time>")
    parser.add_argument(
        "--png", type=Path, default=None, help=f"where to write the plot (default: DIR/{PNG_NAME})"
    )
    parser.add_argument(
        "--metric",
        default=M.EVAL_ACCURACY,
        help="the held-out key a seed sweep compares (default: eval/accuracy; e.g. eval/gsm8k/accuracy)",
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
    report_seeds(console, jobs, args.sweep_dir if args.png is None else args.png.parent, args.metric)
    return 0


def report_seeds(console: Console, jobs: list[Job], out_dir: Path, key: str) -> None:
    """A sweep with some configuration on several seeds: the per-configuration table, the pairs these
    seeds cannot tell apart, and the two PNGs."""
    from grpo_run.tracking import seeds

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
