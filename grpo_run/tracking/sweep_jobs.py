"""A sweep's jobs as the report reads them: each job's overrides, its grpo settings and metrics.jsonl rows.

Reads only what each job left in its run dir (metrics.jsonl, .hydra/overrides.yaml and the resolved
config), so it works offline, without W&B, also on a sweep that is still running.
"""

import json
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import OmegaConf

from grpo_run import metrics as M


@dataclass
class Job:
    path: Path
    overrides: list[str]
    beta: float
    epsilon: float
    group_size: int
    rows: list[dict]  # metrics.jsonl, one dict per step
    label: str = ""
    # Names of the job's reward entries that are models (a reward model or a judge): proxies of the truth,
    # which the report draws beside the held-out accuracy.
    model_rewards: list[str] = field(default_factory=list)

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
    cfg = _job_config(job_dir)
    grpo = cfg.grpo
    lines = (job_dir / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines if line.strip()]
    functions = OmegaConf.select(cfg, "reward.functions", default=None) or []
    model_rewards = [str(f.name) for f in functions if OmegaConf.select(f, "model", default=None) is not None]
    return Job(
        job_dir,
        overrides,
        float(grpo.beta),
        float(grpo.epsilon),
        int(grpo.group_size),
        rows,
        "",
        model_rewards,
    )


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
