"""The checkpoint folders of a run dir: which are complete, which one `latest` names, the newest."""

import os
import shutil
from pathlib import Path

from grpo_run.checkpoint.state import (
    CHECKPOINTS,
    LATEST,
    STATE_FILE,
    TMP_PREFIX,
    CheckpointError,
    describe_position,
    read_state,
)
from grpo_run.tracking import console

# A step's old folder while a re-save of the same step replaces it (`save.publish`).
ASIDE_PREFIX = ".old-"


def restore_set_aside(root: Path) -> None:
    """A re-save killed between its moves: a step folder set aside whose new copy never arrived is put
    back (it is complete: it was renamed whole); one whose new copy is in place is removed. The main
    rank only, before the ranks join or while they wait for it."""
    if not root.is_dir():
        return
    for aside in root.glob(f"{ASIDE_PREFIX}*"):
        if aside.is_symlink() or not aside.is_dir():
            continue
        final = root / aside.name[len(ASIDE_PREFIX) :]
        try:
            if (final / STATE_FILE).is_file():
                shutil.rmtree(aside)
            else:
                shutil.rmtree(final, ignore_errors=True)  # nothing of it, or the start of a folder
                os.rename(aside, final)
                console.print(
                    f"checkpoint: {final.name} restored from {aside.name} (a re-save was cut short)"
                )
        except FileNotFoundError:  # removed meanwhile
            continue


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
        and not p.name.startswith((TMP_PREFIX, ASIDE_PREFIX))
        and (p / STATE_FILE).is_file()
    ]


def refuse_symlinks(run_dir: Path) -> None:
    """A checkpoint folder symlinked into checkpoints/ (to continue from another run) stops the run before
    anything loads, naming it: this run would never resume from it, and its saves would have to replace
    it. resume=<its target> continues from that checkpoint, reading it only."""
    root = run_dir / CHECKPOINTS
    if not root.is_dir():
        return
    for entry in sorted(root.iterdir()):
        if entry.is_symlink():
            raise CheckpointError(
                f"{entry} is a symlink (to {os.readlink(entry)}): a run resumes from, saves into and prunes "
                f"only folders it wrote. To continue from that checkpoint, remove the link and pass "
                f"resume={entry.resolve()} (it is only read; this run saves into {root})"
            )


def newest_complete(root: Path) -> Path | None:
    """The checkpoint `latest` names; if it is missing, the most recently written complete one."""
    named = latest_named(root)
    if named is not None and not named.is_symlink() and (named / STATE_FILE).is_file():
        return named
    done = complete_checkpoints(root)
    return max(done, key=written_at) if done else None


def latest_named(root: Path) -> Path | None:
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


def written_at(folder: Path) -> tuple[int, str]:
    """When the state file was written; the step name breaks ties, since a coarse file-system clock
    (1-2 s on some network file systems) gives checkpoints saved in quick succession one mtime."""
    return (folder / STATE_FILE).stat().st_mtime_ns, folder.name


def describe_saved(run_dir: Path) -> str:
    """What a stopped run leaves to resume from, for its last message: the newest checkpoint, or none."""
    root = run_dir / CHECKPOINTS
    folder = newest_complete(root)
    if folder is None:
        return f"no checkpoint was saved in {root}: a rerun starts from step 0"
    return f"the last checkpoint, {folder} ({describe_position(read_state(folder))}), holds finite weights"


def newest_step(run_dir: Path) -> int | None:
    """The step of the checkpoint a resume would start from (None when there is none)."""
    position = newest_position(run_dir)
    return None if position is None else position[0]


def newest_position(run_dir: Path) -> tuple[int, int] | None:
    """(step, iterations_done) of the checkpoint a resume would start from (None when there is none):
    (4, 0) holds step 4 whole, (4, 1) step 4 and the first optimizer step of step 5."""
    folder = newest_complete(run_dir / CHECKPOINTS)
    if folder is None:
        return None
    state = read_state(folder)
    return state.step, state.iterations_done
