"""The W&B run id a checkpoint keeps, so that a resumed run (even into a new run dir) continues its W&B run."""

from pathlib import Path

from grpo_run.tracking.wandb_run import RUN_ID_FILE


def wandb_run_id(run_dir: str) -> str | None:
    """The W&B run this run logs to, kept in the checkpoint so a resumed run continues it."""
    path = Path(run_dir) / RUN_ID_FILE
    return path.read_text().strip() if path.exists() else None


def keep_run_id(run_dir: Path, run_id: str | None) -> None:
    """A resume into a new run dir continues the checkpoint's W&B run (an existing id file wins)."""
    if run_id and not (run_dir / RUN_ID_FILE).exists():
        (run_dir / RUN_ID_FILE).write_text(run_id + "\n")
