"""Checkpoints: save the whole training state atomically, find the one to resume, restore it exactly.

Layout under the run dir:

    checkpoints/
      step_00000004/          one complete checkpoint
        model.safetensors     \\
        optimizer.pt           } the engine's files (DeepSpeed writes its own sharded layout instead)
        scheduler.pt          /
        rng_rank0.pt          python, numpy, torch (and CUDA) RNG states, one file per rank
        trainer_state.json    step, sampler position, beta, non-finite streak, W&B run id (written last)
      latest                  the name of the newest complete checkpoint
      .tmp-step_00000005/     a save in progress, or one killed mid-write: never resumed, removed later

A save writes everything into `.tmp-<name>` on the same filesystem, waits for every rank
(`engine.barrier`), fsyncs, renames the folder to `<name>` and only then replaces `latest` (an atomic
rename too). A process killed at any point leaves `latest` naming the previous complete checkpoint.
Files are read back with safetensors and `torch.load(weights_only=True)`: never arbitrary pickles.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import pickle
import random
import shutil
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch

from grpo_run.config.schema import CheckpointConfig, Config
from grpo_run.engine.base import Engine
from grpo_run.engine.build import learning_rate
from grpo_run.resume_policy import save_config
from grpo_run.tracking import console
from grpo_run.tracking.wandb_run import RUN_ID_FILE

CHECKPOINTS = "checkpoints"
LATEST = "latest"
STATE_FILE = "trainer_state.json"
MANIFEST = "manifest.json"  # size and sha256 of every other file, written last
TMP_PREFIX = ".tmp-"
FORMAT_VERSION = 1
AUTO = "auto"


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or resumed; the message names the folder."""


@dataclass
class TrainerState:
    """What the loop itself needs to continue; JSON, so a person can read it."""

    step: int
    sampler: dict[str, int]
    beta: float
    nonfinite_streak: int
    world_size: int
    wandb_run_id: str | None
    version: int = FORMAT_VERSION
    alarms: dict = field(default_factory=dict)  # the in-flight alarms' streaks (tracking/alarms.py)


def step_name(step: int) -> str:
    return f"step_{step:08d}"


def is_due(cfg: CheckpointConfig, step: int, max_steps: int) -> bool:
    """Every `every_steps` steps, and at the last step when `save_final`."""
    periodic = cfg.every_steps > 0 and step % cfg.every_steps == 0
    return periodic or (cfg.save_final and step == max_steps)


# ---------------------------------------------------------------------------------------------- save


def save(engine: Engine, cfg: Config, state: TrainerState, rng: dict[str, Any] | None = None) -> Path:
    """Write the checkpoint of `state.step`: the engine's files, every rank's RNG states (`rng`, taken
    earlier, or the current ones) and the loop's state (every rank calls this); return its folder.

    A write that fails (a full disk, a quota, an I/O error) removes the unfinished folder and raises
    `CheckpointError` naming it and the cause; `latest` still names the previous checkpoint."""
    step = state.step
    root = Path(cfg.run_dir) / CHECKPOINTS
    ensure_finite_weights(engine, step)
    tmp = root / f"{TMP_PREFIX}{step_name(step)}"
    final = root / step_name(step)
    try:
        if engine.is_main:
            remove_unfinished(root)
            tmp.mkdir(parents=True)
        engine.barrier()
        engine.save_state(tmp)
        torch.save(rng if rng is not None else rng_state(), tmp / f"rng_rank{engine.rank}.pt")
        engine.barrier()  # every rank's files are written
        if engine.is_main:
            save_config(cfg, tmp)  # what resume compares the new command line against
            _write_json(tmp / STATE_FILE, asdict(state))
            write_manifest(tmp)  # size and checksum of every file: resume verifies them
            _fsync_tree(tmp)
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


LOW_SPACE_BYTES = 1 << 20


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


def wandb_run_id(run_dir: str) -> str | None:
    """The W&B run this run logs to, kept in the checkpoint so a resumed run continues it."""
    path = Path(run_dir) / RUN_ID_FILE
    return path.read_text().strip() if path.exists() else None


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


def set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    keys = n["keys"].numpy().astype(np.uint32)
    np.random.set_state(("MT19937", keys, n["pos"], n["has_gauss"], n["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if state["cuda"]:
        torch.cuda.set_rng_state_all(state["cuda"])


def publish(root: Path, tmp: Path, final: Path) -> None:
    """Rename the finished folder into place, then point `latest` at it (both atomic renames)."""
    if final.exists():  # the same step saved again (a run resumed from an earlier checkpoint)
        shutil.rmtree(final)
    os.rename(tmp, final)
    pointer = root / f"{LATEST}.tmp"
    pointer.write_text(final.name + "\n")
    _fsync_file(pointer)
    os.replace(pointer, root / LATEST)
    _fsync_file(root)


def prune(root: Path, keep_last: int) -> None:
    """Delete all but the `keep_last` most recently written checkpoints (never the one `latest` names)."""
    latest = newest_complete(root)
    done = sorted(complete_checkpoints(root), key=_written_at)
    for folder in done[:-keep_last]:
        if folder != latest:
            shutil.rmtree(folder)


def remove_unfinished(root: Path) -> None:
    """Temporary folders of saves that never finished (the process was killed mid-write)."""
    if root.is_dir():
        for folder in root.glob(f"{TMP_PREFIX}*"):
            shutil.rmtree(folder, ignore_errors=True)


# -------------------------------------------------------------------------------------------- resume


def complete_checkpoints(root: Path) -> list[Path]:
    """Renamed folders holding the state file (written last, so every other file is there too)."""
    if not root.is_dir():
        return []
    # Never a symlink: pruning one would delete outside the run dir, resuming one trains on foreign files.
    return [
        p
        for p in root.iterdir()
        if not p.is_symlink()
        and p.is_dir()
        and not p.name.startswith(TMP_PREFIX)
        and (p / STATE_FILE).is_file()
    ]


def newest_complete(root: Path) -> Path | None:
    """The checkpoint `latest` names; if it is missing, the most recently written complete one."""
    named = _latest_named(root)
    if named is not None and not named.is_symlink() and (named / STATE_FILE).is_file():
        return named
    done = complete_checkpoints(root)
    return max(done, key=_written_at) if done else None


def _latest_named(root: Path) -> Path | None:
    """The folder `latest` names, or None when it is missing or unreadable (torn, not UTF-8)."""
    pointer = root / LATEST
    try:
        name = pointer.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as err:
        if pointer.exists():
            console.print(f"resume: ignoring {pointer}: {err}", soft_wrap=True, markup=False)
        return None
    if not name or "/" in name or name.startswith("."):
        return None
    return root / name


def newest_intact(root: Path) -> Path | None:
    """The newest checkpoint that passes `damage`: `latest` first, then by time written. Each damaged
    one is reported by path; none intact among several is an error naming the first damage found."""
    named = _latest_named(root)
    ordered = sorted(complete_checkpoints(root), key=_written_at, reverse=True)
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
    manifest = folder / MANIFEST
    if not manifest.is_file():
        return None  # saved before manifests existed: the state file is all there is to check
    try:
        files = json.loads(manifest.read_text(encoding="utf-8"))["files"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"{manifest}: unreadable ({type(err).__name__}: {err})"
    for name, entry in files.items():
        path = folder / name
        if path.is_symlink() or not path.is_file():
            return f"{path}: missing"
        size = path.stat().st_size
        if size != entry["size"]:
            return f"{path}: {size} bytes, the manifest says {entry['size']} (truncated or torn)"
        if _sha256(path) != entry["sha256"]:
            return f"{path}: its checksum differs from the manifest's (damaged)"
    return None


def write_manifest(folder: Path) -> None:
    files = {
        str(p.relative_to(folder)): {"size": p.stat().st_size, "sha256": _sha256(p)}
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != MANIFEST
    }
    _write_json(folder / MANIFEST, {"version": 1, "files": files})


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def describe_saved(run_dir: Path) -> str:
    """What a stopped run leaves to resume from, for its last message: the newest checkpoint, or none."""
    root = run_dir / CHECKPOINTS
    folder = newest_complete(root)
    if folder is None:
        return f"no checkpoint was saved in {root}: a rerun starts from step 0"
    return f"the last checkpoint, {folder} (step {read_state(folder).step}), holds finite weights"


def newest_step(run_dir: Path) -> int | None:
    """The step of the checkpoint a resume would start from (None when there is none)."""
    folder = newest_complete(run_dir / CHECKPOINTS)
    return None if folder is None else read_state(folder).step


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


def read_state(folder: Path) -> TrainerState:
    """The state file, every value checked by name: a torn or edited file never resumes half-read."""
    path = folder / STATE_FILE
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{path}: unreadable ({type(err).__name__}: {err})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: not a JSON object")
    if data.get("version") != FORMAT_VERSION:
        raise CheckpointError(f"{folder}: checkpoint format {data.get('version')}, expected {FORMAT_VERSION}")

    def count(key: str, low: int) -> None:
        value = data.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise CheckpointError(f"{path}: {key}={value!r} must be an integer >= {low}")

    count("step", 0)
    count("nonfinite_streak", 0)
    count("world_size", 1)
    beta = data.get("beta")
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not math.isfinite(beta) or beta < 0:
        raise CheckpointError(f"{path}: beta={beta!r} must be a finite number >= 0")
    sampler = data.get("sampler")
    if not isinstance(sampler, dict) or not all(
        isinstance(v, int) and not isinstance(v, bool) for v in sampler.values()
    ):
        raise CheckpointError(f"{path}: sampler={sampler!r} must map names to integers")
    if not isinstance(data.get("wandb_run_id"), (str, type(None))):
        raise CheckpointError(f"{path}: wandb_run_id={data.get('wandb_run_id')!r} must be a string or null")
    data.setdefault("alarms", {})  # checkpoints written before the alarms existed
    alarms = data["alarms"]
    if not isinstance(alarms, dict) or not all(
        isinstance(v, list) if k == "fired" else isinstance(v, int) and not isinstance(v, bool) and v >= 0
        for k, v in alarms.items()
    ):
        raise CheckpointError(f"{path}: alarms={alarms!r} must map streak names to integers >= 0")
    known = {f.name for f in fields(TrainerState)}
    if set(data) != known:
        raise CheckpointError(f"{path}: keys {sorted(data)}, expected {sorted(known)}")
    return TrainerState(**data)


def prepare_run_dir(run_dir: Path, folder: Path | None, start_step: int) -> None:
    """Before the sinks open (main rank): drop metrics rows past the resumed step; keep the W&B run id."""
    if folder is None:
        console.print(f"resume: no complete checkpoint in {run_dir / CHECKPOINTS}; starting fresh")
    metrics = run_dir / "metrics.jsonl"
    if metrics.exists():
        # Steps after the checkpoint are trained again; a fresh start (step 0) redoes everything.
        lines = metrics.read_text().splitlines()
        kept = [line for line in lines if start_step > 0 and 0 <= _row_step(line) <= start_step]
        _write_text_atomic(metrics, "".join(line + "\n" for line in kept))
    run_id = read_state(folder).wandb_run_id if folder is not None else None
    if run_id and not (run_dir / RUN_ID_FILE).exists():
        (run_dir / RUN_ID_FILE).write_text(run_id + "\n")  # a resume into a new dir continues the W&B run


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
    apply_lr(engine, learning_rate(cfg))  # lora.lr for adapters, else trainer.lr
    # Building the run drew from the global generators; the checkpoint's states win (call this last).
    set_rng_state(torch.load(folder / f"rng_rank{engine.rank}.pt", weights_only=True))
    if engine.is_main:
        console.print(f"resumed from {folder} (step {state.step})")
    return state


def apply_lr(engine, lr: float) -> None:
    """The configured lr wins over the checkpoint's: the schedule's base lr becomes `lr`, and the current
    lr is `lr` times the schedule's factor at the resumed step (the same value when lr did not change)."""
    # The single-process engine's LambdaLR, or the one DeepSpeed wraps (the same torch object).
    scheduler = getattr(engine, "scheduler", None) or getattr(
        getattr(engine, "_ds", None), "lr_scheduler", None
    )
    if scheduler is None:
        return
    factors = [
        group["lr"] / base if base else 1.0
        for group, base in zip(scheduler.optimizer.param_groups, scheduler.base_lrs, strict=True)
    ]
    scheduler.base_lrs = [lr] * len(scheduler.base_lrs)
    for group, factor in zip(scheduler.optimizer.param_groups, factors, strict=True):
        group["lr"] = lr * factor
        if "initial_lr" in group:
            group["initial_lr"] = lr
    scheduler._last_lr = [group["lr"] for group in scheduler.optimizer.param_groups]


# ----------------------------------------------------------------------------------------- file helpers


def _row_step(line: str) -> int:
    """The step of a metrics.jsonl row; -1 for a blank or torn line (a kill mid-write), which is dropped."""
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return -1


def _written_at(folder: Path) -> tuple[int, str]:
    """When the state file was written; the step name breaks ties, since a coarse file-system clock
    (1-2 s on some network file systems) gives checkpoints saved in quick succession one mtime."""
    return (folder / STATE_FILE).stat().st_mtime_ns, folder.name


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=1) + "\n")


def _write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    _fsync_file(tmp)
    os.replace(tmp, path)


def _fsync_file(path: Path) -> None:
    """Flush a file (or a folder's entries) to disk, so a power cut cannot undo a rename's contents."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(folder: Path) -> None:
    for path in sorted(folder.rglob("*"), reverse=True):
        _fsync_file(path)
    _fsync_file(folder)
