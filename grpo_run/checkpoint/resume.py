"""Resuming: find the checkpoint to continue from (verified against its manifest), restore it exactly."""

import os
import pickle
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from grpo_run.checkpoint.folders import complete_checkpoints, latest_named, written_at
from grpo_run.checkpoint.manifest import manifest_damage
from grpo_run.checkpoint.metrics_log import trim_metrics
from grpo_run.checkpoint.state import (
    AUTO,
    CHECKPOINTS,
    STATE_FILE,
    CheckpointError,
    TrainerState,
    describe_position,
    read_state,
)
from grpo_run.checkpoint.wandb_id import keep_run_id
from grpo_run.config.schema import Config
from grpo_run.engine.base import Engine
from grpo_run.engine.build import learning_rate
from grpo_run.tracking import console


def newest_intact(root: Path) -> Path | None:
    """The newest checkpoint that passes `damage`: `latest` first, then by time written. Each damaged
    one is reported by path; none intact among several is an error naming the first damage found."""
    named = latest_named(root)
    ordered = sorted(complete_checkpoints(root), key=written_at, reverse=True)
    if named is not None and (named in ordered or named.is_symlink()):
        ordered = [named, *[p for p in ordered if p != named]]
    problems = []
    for folder in ordered:
        problem = damage(folder)
        if problem is None:
            return folder
        problems.append(problem)
        console.print(f"resume: skipping a damaged checkpoint: {problem}", soft_wrap=True, markup=False)
    if problems:
        raise CheckpointError(f"no intact checkpoint in {root}; the newest: {problems[0]}")
    return None


def damage(folder: Path) -> str | None:
    """None for an intact checkpoint, else what is wrong, naming the file (docs/reliability.md)."""
    if folder.is_symlink():
        return f"{folder}: a symlink (to {os.readlink(folder)}), not a checkpoint this run wrote"
    try:
        read_state(folder)
    except CheckpointError as err:
        return str(err)
    return manifest_damage(folder)


def find_resume(resume: str | None, run_dir: Path) -> Path | None:
    """The checkpoint folder to continue from: None (fresh), `auto` (this run dir's newest), or a path.

    A path may name a checkpoint folder, or a run dir / its `checkpoints/` folder (their newest).
    """
    if resume is None:
        return None
    if resume == AUTO:
        return newest_intact(run_dir / CHECKPOINTS)
    path = Path(resume)
    if (path / STATE_FILE).is_file():
        problem = damage(path)  # a folder named explicitly: the run stops rather than picking another
        if problem is not None:
            raise CheckpointError(f"resume={resume}: {problem}")
        return path
    found = newest_intact(path / CHECKPOINTS) or newest_intact(path)
    if found is None:
        raise CheckpointError(f"resume={resume}: no complete checkpoint there (looked for {STATE_FILE})")
    return found


def prepare_run_dir(run_dir: Path, folder: Path | None, start_step: int) -> None:
    """Before the sinks open (main rank): drop metrics rows past the resumed step; keep the W&B run id."""
    if folder is None:
        console.print(f"resume: no complete checkpoint in {run_dir / CHECKPOINTS}; starting fresh")
    trim_metrics(run_dir, start_step)  # steps after the checkpoint are trained again
    keep_run_id(run_dir, read_state(folder).wandb_run_id if folder is not None else None)


def restore(engine: Engine, cfg: Config, folder: Path) -> TrainerState:
    """Load the checkpoint's weights, optimizer, LR schedule and RNG states into the engine and the process;
    return the loop's state for the caller to apply. A missing, unreadable or refused file is named."""
    try:
        return _restore(engine, cfg, folder)
    except pickle.UnpicklingError as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CheckpointError(
            f"{folder}: a file there holds a pickle that torch.load(weights_only=True) refuses, so it was "
            f"not run: {first}"
        ) from None
    except OSError as err:
        raise CheckpointError(f"{err.filename or folder}: {err.strerror or err}") from None


def _restore(engine: Engine, cfg: Config, folder: Path) -> TrainerState:
    state = read_state(folder)
    if state.world_size != engine.world_size:
        raise CheckpointError(
            f"{folder}: saved with {state.world_size} ranks, this run has {engine.world_size}"
        )
    engine.load_state(folder)
    # The configured lr wins over the checkpoint's (lora.lr for adapters, else trainer.lr).
    engine.set_base_lr(learning_rate(cfg))
    # Building the run drew from the global generators; the checkpoint's states win (call this last).
    set_rng_state(torch.load(folder / f"rng_rank{engine.rank}.pt", weights_only=True))
    if engine.is_main:
        console.print(f"resumed from {folder} ({describe_position(state)})")
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    keys = n["keys"].numpy().astype(np.uint32)
    np.random.set_state(("MT19937", keys, n["pos"], n["has_gauss"], n["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if state["cuda"]:
        torch.cuda.set_rng_state_all(state["cuda"])
