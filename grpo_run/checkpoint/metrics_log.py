"""metrics.jsonl on resume: the rows past the resumed step are dropped, since those steps are trained again."""

import json
from pathlib import Path

from grpo_run.checkpoint.files import write_text_atomic

METRICS_FILE = "metrics.jsonl"


def trim_metrics(run_dir: Path, start_step: int) -> None:
    """Keep the rows of steps 0..start_step; a fresh start (step 0) redoes everything and keeps none."""
    metrics = run_dir / METRICS_FILE
    if metrics.exists():
        lines = metrics.read_text().splitlines()
        kept = [line for line in lines if start_step > 0 and 0 <= _row_step(line) <= start_step]
        write_text_atomic(metrics, "".join(line + "\n" for line in kept))


def _row_step(line: str) -> int:
    """The step of a metrics.jsonl row; -1 for a blank or torn line (a kill mid-write), which is dropped."""
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return -1
