"""The seed sweep's report (`grpo-run -m sweep=seeds ...`, then `grpo-run-report DIR`): jobs grouped by
every override except `trainer.seed`, each configuration's held-out gain as mean ± a 95% t-interval
over its seeds, curves with a band over seeds, a bar chart with error bars, and the pairs of
configurations that these seeds cannot tell apart (docs/evaluation.md).
"""

import math
from dataclasses import dataclass, field
from pathlib import Path

from rich.table import Table

from grpo_run import metrics as M
from grpo_run.algo.intervals import intervals_overlap, t_interval
from grpo_run.tracking.sweep_jobs import Job

SEED_KEY = "trainer.seed"
CURVES_PNG = "seeds_curves.png"
GAIN_PNG = "seeds_gain.png"


@dataclass
class Group:
    """The jobs of one configuration: the same overrides but for the seed."""

    overrides: tuple[str, ...]  # sorted, without trainer.seed
    jobs: list[Job] = field(default_factory=list)
    label: str = ""

    def seeds(self) -> list[str]:
        return [job_seed(j) for j in self.jobs]

    def gains(self, key: str) -> list[float]:
        """Each seed's held-out gain (jobs that evaluated fewer than twice are left out)."""
        return [g for g in (held_out_gain(j, key) for j in self.jobs) if g is not None]

    def gain_interval(self, key: str) -> tuple[float, float, float]:
        """(mean, low, high) of the gain over seeds: Student's t with n - 1 degrees of freedom."""
        return t_interval(self.gains(key))


def job_seed(job: Job) -> str:
    for o in job.overrides:
        key, _, value = o.partition("=")
        if key.lstrip("+~") == SEED_KEY:
            return value
    return "default"


def held_out_gain(job: Job, key: str) -> float | None:
    """The held-out value after training minus before (first and last evaluation of the job)."""
    _, values = job.series(key)
    return values[-1] - values[0] if len(values) >= 2 else None


def held_out_key(jobs: list[Job]) -> str:
    """The held-out metric a seed sweep compares by default: eval/accuracy, or eval/reward_mean where no
    job logged an accuracy (runs with their own reward on data without gold answers, eval.reward)."""
    if not any(job.series(M.EVAL_ACCURACY)[0] for job in jobs) and any(
        job.series(M.EVAL_REWARD_MEAN)[0] for job in jobs
    ):
        return M.EVAL_REWARD_MEAN
    return M.EVAL_ACCURACY


def is_seed_sweep(jobs: list[Job]) -> bool:
    """Some configuration ran on more than one seed."""
    return any(len(g.jobs) > 1 for g in group_jobs(jobs))


def group_jobs(jobs: list[Job]) -> list[Group]:
    """Groups in the order of their first job, labelled by the overrides that differ between groups."""
    groups: dict[tuple[str, ...], Group] = {}
    for job in jobs:
        rest = tuple(sorted(o for o in job.overrides if o.partition("=")[0].lstrip("+~") != SEED_KEY))
        groups.setdefault(rest, Group(rest)).jobs.append(job)
    result = list(groups.values())
    values: dict[str, set[str]] = {}
    for g in result:
        for o in g.overrides:
            key, _, value = o.partition("=")
            values.setdefault(key, set()).add(value)
    varying = {k for k, v in values.items() if len(v) > 1 or any(k not in _keys(g) for g in result)}
    for g in result:
        parts = [o for o in g.overrides if o.partition("=")[0] in varying]
        short = [f"{k.split('.')[-1]}={v}" for k, _, v in (p.partition("=") for p in parts)]
        g.label = ",".join(short) or "all jobs"
    return result


def _keys(group: Group) -> set[str]:
    return {o.partition("=")[0] for o in group.overrides}


def _fmt(x: float, digits: int = 3) -> str:
    return "–" if math.isnan(x) else f"{x:+.{digits}f}"


def _final_values(group: Group, key: str) -> list[float]:
    return [v for v in (j.final(key) for j in group.jobs) if v is not None and math.isfinite(v)]


def build_seed_table(groups: list[Group], key: str = M.EVAL_ACCURACY) -> Table:
    """One row per configuration: n seeds, the gain's mean and 95% t-interval, each seed's gain."""
    table = Table(
        title=f"{len(groups)} configurations, {sum(len(g.jobs) for g in groups)} jobs: gain in {key}"
    )
    for name in ["configuration", "n", "gain mean", "95% t-interval", "per seed (seed: gain)", "final"]:
        table.add_column(
            name, justify="left" if name in ("configuration", "per seed (seed: gain)") else "right"
        )
    for g in groups:
        mean, low, high = g.gain_interval(key)
        per_seed = [
            f"{s}: {_fmt(gain)}"
            for s, gain in zip(g.seeds(), (held_out_gain(j, key) for j in g.jobs))
            if gain is not None
        ]
        finals = _final_values(g, key)
        final = f"{sum(finals) / len(finals):.3f}" if finals else "–"
        interval = "–" if math.isnan(low) else f"[{_fmt(low)}, {_fmt(high)}]"
        table.add_row(
            g.label, str(len(g.gains(key))), _fmt(mean), interval, "  ".join(per_seed) or "–", final
        )
    table.caption = "gain: last minus first held-out evaluation of each job; t-interval over seeds (n - 1 df)"
    return table


def overlapping_pairs(groups: list[Group], key: str = M.EVAL_ACCURACY) -> list[tuple[Group, Group]]:
    """Pairs of configurations whose gain intervals overlap: not distinguishable with these seeds.

    Overlapping 95% intervals is a conservative test (two means can differ significantly while their
    intervals still touch); a pair that does not overlap is clearly apart.
    """
    spans = [(g, g.gain_interval(key)[1:]) for g in groups if g.gains(key)]
    return [
        (a, b)
        for i, (a, span_a) in enumerate(spans)
        for b, span_b in spans[i + 1 :]
        if intervals_overlap(span_a, span_b)
    ]


def _mean_curve(group: Group, key: str) -> tuple[list[int], list[float], list[float], list[float]]:
    """Per step: the mean over the group's seeds and the band (min and max over seeds)."""
    by_step: dict[int, list[float]] = {}
    for job in group.jobs:
        for step, value in zip(*job.series(key)):
            if math.isfinite(value):
                by_step.setdefault(step, []).append(value)
    steps = sorted(by_step)
    return (
        steps,
        [sum(by_step[s]) / len(by_step[s]) for s in steps],
        [min(by_step[s]) for s in steps],
        [max(by_step[s]) for s in steps],
    )


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a cluster or in CI
    import matplotlib.pyplot as plt

    return plt


def plot_seed_curves(groups: list[Group], png: Path, key: str = M.EVAL_ACCURACY) -> Path:
    """Reward mean and the held-out metric against the step: a line per configuration (mean over its
    seeds) with a band from the lowest to the highest seed."""
    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator

    panels = [(M.REWARD_MEAN, "reward mean"), (key, f"{key} (held-out)")]
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4), squeeze=False)
    for ax, (metric, title) in zip(axes[0], panels):
        for i, g in enumerate(groups):
            steps, mean, low, high = _mean_curve(g, metric)
            if not steps:
                continue
            color = f"C{i % 10}"
            ax.plot(
                steps,
                mean,
                color=color,
                marker="." if len(steps) < 20 else None,
                label=f"{g.label} (n={len(g.jobs)})",
            )
            ax.fill_between(steps, low, high, color=color, alpha=0.2, linewidth=0)
        ax.set_title(f"{title}: mean over seeds, band min–max")
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="lower center", ncol=min(3, len(labels)), fontsize="small")
    fig.tight_layout(rect=(0, 0.08 + 0.04 * (len(labels) // 3), 1, 1))
    return _save(fig, plt, png)


def plot_gain_bars(groups: list[Group], png: Path, key: str = M.EVAL_ACCURACY) -> Path:
    """The held-out gain per configuration: a bar at the mean over seeds, the 95% t-interval as the
    error bar, and each seed's gain as a dot."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(4, 1.6 * len(groups) + 2), 4))
    for i, g in enumerate(groups):
        gains = g.gains(key)
        if not gains:
            continue
        mean, low, high = g.gain_interval(key)
        yerr = None if math.isnan(low) else [[mean - low], [high - mean]]
        ax.bar(i, mean, color=f"C{i % 10}", alpha=0.6, yerr=yerr, capsize=6)
        ax.scatter([i] * len(gains), gains, color="black", s=14, zorder=3)
    ax.set_xticks(range(len(groups)), [f"{g.label}\nn={len(g.gains(key))}" for g in groups], fontsize="small")
    ax.axhline(0, color="grey", linewidth=0.8)
    ax.set_ylabel(f"gain in {key}")
    ax.set_title("held-out gain: mean over seeds, 95% t-interval, dots = seeds")
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    return _save(fig, plt, png)


def _save(fig, plt, png: Path) -> Path:
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return png
