"""Writing a checkpoint atomically: into `.tmp-<name>`, every rank's files, fsync, rename, then `latest`."""

import os
import random
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

from grpo_run.checkpoint.files import fsync_file, fsync_tree, write_json
from grpo_run.checkpoint.folders import (
    ASIDE_PREFIX,
    complete_checkpoints,
    describe_saved,
    newest_complete,
    restore_set_aside,
    written_at,
)
from grpo_run.checkpoint.manifest import write_manifest
from grpo_run.checkpoint.state import (
    CHECKPOINTS,
    LATEST,
    STATE_FILE,
    TMP_PREFIX,
    CheckpointError,
    TrainerState,
    folder_name,
)
from grpo_run.config.schema import CheckpointConfig, Config
from grpo_run.engine.base import Engine
from grpo_run.safety.resume_policy import save_config

LOW_SPACE_BYTES = 1 << 20


def is_due(cfg: CheckpointConfig, step: int, max_steps: int) -> bool:
    """Every `every_steps` steps, and at the last step when `save_final`."""
    periodic = cfg.every_steps > 0 and step % cfg.every_steps == 0
    return periodic or (cfg.save_final and step == max_steps)


def save(
    engine: Engine,
    cfg: Config,
    state: TrainerState,
    rng: dict[str, Any] | None = None,
    files: dict[str, dict[str, torch.Tensor]] | None = None,
    rank_files: dict[str, Any] | None = None,
) -> Path:
    """Write the checkpoint of `state.step`: the engine's files, every rank's RNG states (`rng`, taken
    earlier, or the current ones), the loop's state and `files` (name -> tensors, written by the main
    rank with safetensors: what the rollout source needs, `RolloutSource.checkpoint_files`) and
    `rank_files` (name -> an object torch.save writes, this rank's own: a step's remainder); every rank
    calls this; return its folder (`folder_name`: a state inside a step has its own).

    A write that fails (a full disk, a quota, an I/O error) removes the unfinished folder and raises
    `CheckpointError` naming it and the cause; `latest` still names the previous checkpoint."""
    step = state.step
    root = Path(cfg.run_dir) / CHECKPOINTS
    ensure_finite_weights(engine, step)
    tmp = root / f"{TMP_PREFIX}{folder_name(state)}"
    final = root / folder_name(state)
    try:
        if engine.is_main:
            remove_unfinished(root)
            tmp.mkdir(parents=True)
        engine.barrier()
        engine.save_state(tmp)
        torch.save(rng if rng is not None else rng_state(), tmp / f"rng_rank{engine.rank}.pt")
        for name, contents in (rank_files or {}).items():
            torch.save(contents, tmp / name)
        engine.barrier()  # every rank's files are written
        if engine.is_main:
            save_config(cfg, tmp)  # what resume compares the new command line against
            for name, tensors in (files or {}).items():
                save_file(tensors, str(tmp / name))
            write_json(tmp / STATE_FILE, asdict(state))
            write_manifest(tmp)  # size and checksum of every file: resume verifies them
            fsync_tree(tmp)
            publish(root, tmp, final)
    except Exception as err:  # torch and safetensors report a full disk as RuntimeError / SafetensorError
        cause = write_failure(err, root)
        shutil.rmtree(tmp, ignore_errors=True)  # never left behind half-written; frees the space it took
        (root / f"{LATEST}.tmp").unlink(missing_ok=True)
        raise CheckpointError(
            f"{tmp}: the checkpoint of step {step} could not be written: {cause}; {describe_saved(Path(cfg.run_dir))}"
        ) from err
    if engine.is_main:
        prune(root, cfg.checkpoint.keep_last)
    engine.barrier()  # nobody moves on (or exits) before `latest` names the new checkpoint
    return final


def write_failure(err: BaseException, root: Path) -> str:
    """The cause of a failed write in words. torch's writer says only "unexpected pos ..." when the disk
    fills, so a filesystem left with under 1 MiB free is named as full."""
    if isinstance(err, OSError) and err.strerror:
        return err.strerror
    text = (str(err).strip().splitlines() or [type(err).__name__])[0]
    try:
        free = shutil.disk_usage(root).free
    except OSError:
        free = None
    if "os error 28" in text or (free is not None and free < LOW_SPACE_BYTES):
        return f"No space left on device ({free} bytes free on {root}; the writer said: {text})"
    return f"{type(err).__name__}: {text}"


def ensure_finite_weights(engine: Engine, step: int) -> None:
    """Refuse to save NaN/inf weights: a checkpoint must always be a state worth resuming."""
    params = [p.detach() for p in engine.module.parameters()]
    finite = bool(torch.stack([torch.isfinite(p).all() for p in params]).all())
    if engine.broadcast_flag(not finite):
        raise CheckpointError(f"step {step}: the weights hold NaN/inf values; no checkpoint written")


def rng_state() -> dict[str, Any]:
    """Every global generator, as tensors and plain containers (loadable with weights_only=True)."""
    _, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": {
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def publish(root: Path, tmp: Path, final: Path) -> None:
    """Rename the finished folder into place, then point `latest` at it (both atomic renames).

    The same step saved again (a run resumed from an earlier checkpoint, a stop re-saving it): the old
    folder is renamed aside first and removed only once the new one is in place, so a kill at any point
    leaves a complete copy of the step (`restore_set_aside` puts an aside copy back when it is the only
    one)."""
    aside = root / f"{ASIDE_PREFIX}{final.name}"
    if final.exists():
        shutil.rmtree(aside, ignore_errors=True)  # a copy set aside by a save killed after its rename
        os.rename(final, aside)
        fsync_file(root)
    os.rename(tmp, final)
    pointer = root / f"{LATEST}.tmp"
    pointer.write_text(final.name + "\n")
    fsync_file(pointer)
    os.replace(pointer, root / LATEST)
    fsync_file(root)
    shutil.rmtree(aside, ignore_errors=True)


def prune(root: Path, keep_last: int) -> None:
    """Delete all but the `keep_last` most recently written checkpoints (never the one `latest` names)."""
    latest = newest_complete(root)
    done = sorted(complete_checkpoints(root), key=written_at)
    for folder in done[:-keep_last]:
        if folder != latest:
            shutil.rmtree(folder)


def remove_unfinished(root: Path) -> None:
    """Temporary folders of saves that never finished (the process was killed mid-write); a step's copy
    set aside by a re-save that was killed goes back first."""
    restore_set_aside(root)
    if root.is_dir():
        for folder in root.glob(f"{TMP_PREFIX}*"):
            shutil.rmtree(folder, ignore_errors=True)
