"""Checkpoints, resume and the non-finite guard (grpo_run/checkpoint/, docs/reliability.md); mode=plan's
device and the in-flight alarms (docs/plan.md)."""

import math
from pathlib import Path

from grpo_run.config.checks.base import check
from grpo_run.config.schema import Config


def validate_reliability(cfg: Config) -> None:
    """Checkpoints, resume and the non-finite guard (grpo_run/checkpoint/, docs/reliability.md)."""
    c, t = cfg.checkpoint, cfg.trainer
    check(c.every_steps >= 0, "checkpoint.every_steps", c.every_steps, "must be >= 0 (0: only at the end)")
    check(c.keep_last >= 1, "checkpoint.keep_last", c.keep_last, "must be >= 1")
    check(
        t.max_consecutive_nonfinite >= 1,
        "trainer.max_consecutive_nonfinite",
        t.max_consecutive_nonfinite,
        "must be >= 1",
    )
    ok = math.isfinite(t.stop_within_s) and t.stop_within_s > 0
    check(ok, "trainer.stop_within_s", t.stop_within_s, "must be a number of seconds > 0")
    if cfg.resume not in (None, "auto"):
        check(
            Path(cfg.resume).is_dir(),
            "resume",
            cfg.resume,
            "must be null, auto, or an existing checkpoint folder (or a run dir holding checkpoints/)",
        )


def validate_plan_and_alerts(cfg: Config) -> None:
    """mode=plan's device and the in-flight alarms' thresholds (docs/plan.md)."""
    p, a = cfg.plan, cfg.alerts
    if p.device_memory_gb is not None:
        ok = math.isfinite(p.device_memory_gb) and p.device_memory_gb > 0
        check(ok, "plan.device_memory_gb", p.device_memory_gb, "must be a number > 0 (GB), or null")
    check(p.num_records >= 1, "plan.num_records", p.num_records, "must be >= 1")
    check(
        0 < a.truncated_fraction <= 1, "alerts.truncated_fraction", a.truncated_fraction, "must lie in (0, 1]"
    )
    for key in ("truncated_steps", "zero_std_steps", "nonfinite_steps", "empty_steps"):
        check(getattr(a, key) >= 1, f"alerts.{key}", getattr(a, key), "must be >= 1 (steps in a row)")
    ok = 0 <= a.reward_failure_fraction < 1
    check(ok, "alerts.reward_failure_fraction", a.reward_failure_fraction, "must lie in [0, 1)")
    check(a.kl_max > 0, "alerts.kl_max", a.kl_max, "must be > 0")
    ok = math.isfinite(a.empty_length) and a.empty_length > 0
    check(ok, "alerts.empty_length", a.empty_length, "must be a number > 0 (tokens)")
