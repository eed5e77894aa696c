"""Re-saving a step (a resumed run reaching a step it saved before, a stop re-saving it) renames the old
folder aside first and removes it only once the new one is in place: a kill at any point between the
moves leaves a complete copy of the step that resume finds (grpo_run/checkpoint/save.py `publish`).
The kill is simulated by the file operation it lands on raising an exception that nothing catches, as a
SIGKILL leaves the folders: no cleanup runs."""

import os
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file

from grpo_run import checkpoint
from tests.builders import config
from tests.helpers import FAST
from tests.test_checkpoint import state_at, tiny_engine, train_once


class Killed(BaseException):
    """The process died here."""


def weights(folder: Path) -> dict:
    return load_file(folder / "model.safetensors")


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(bool((a[k] == b[k]).all()) for k in a)


def resave_killed(tmp_path: Path, monkeypatch, where: str) -> tuple[Path, dict]:
    """Save step 2, train, save step 2 again killed at `where`; (the step's folder, its first weights)."""
    cfg = config(FAST, tmp_path / "run")
    engine = tiny_engine()
    folder = checkpoint.save(engine, cfg, state_at(2))
    old = weights(folder)
    train_once(engine)
    rename, rmtree = os.rename, shutil.rmtree

    def killed_rename(src, dst):
        moving_old = Path(src).name == folder.name and Path(dst).name.startswith(".old-")
        moving_new = Path(src).name.startswith(checkpoint.TMP_PREFIX)
        if (where == "setting the old copy aside" and moving_old) or (
            where == "moving the new in" and moving_new
        ):
            raise Killed
        rename(src, dst)

    def killed_rmtree(path, *args, **kwargs):
        if where == "removing the old copy" and Path(path).name.startswith(".old-"):
            if Path(path).exists():
                raise Killed
        rmtree(path, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(os, "rename", killed_rename)
        patch.setattr(shutil, "rmtree", killed_rmtree)
        with pytest.raises(Killed):
            checkpoint.save(engine, cfg, state_at(2))
    return folder, old


@pytest.mark.parametrize(
    "where, survivor",
    [
        ("setting the old copy aside", "old"),
        ("moving the new in", "old"),
        ("removing the old copy", "new"),
    ],
)
def test_a_kill_between_the_moves_of_a_resave_leaves_a_complete_copy_resume_finds(
    tmp_path, monkeypatch, where, survivor
):
    folder, old = resave_killed(tmp_path, monkeypatch, where)
    root = folder.parent
    # What the next start does before it looks for a checkpoint (run_context.build_context).
    checkpoint.restore_set_aside(root)
    found = checkpoint.find_resume("auto", tmp_path / "run")
    assert found == folder and checkpoint.damage(found) is None
    assert not list(root.glob(".old-*"))  # the set-aside copy is back in place or gone
    assert same(weights(found), old) == (survivor == "old")
    checkpoint.remove_unfinished(root)  # the next save clears the unfinished new copy
    assert [p.name for p in root.iterdir() if p.is_dir()] == [folder.name]


def test_a_resave_that_completes_leaves_only_the_new_copy(tmp_path):
    cfg = config(FAST, tmp_path / "run")
    engine = tiny_engine()
    folder = checkpoint.save(engine, cfg, state_at(2))
    old = weights(folder)
    train_once(engine)
    assert checkpoint.save(engine, cfg, state_at(2)) == folder
    assert not same(weights(folder), old) and checkpoint.damage(folder) is None
    assert sorted(p.name for p in folder.parent.iterdir()) == [checkpoint.LATEST, folder.name]
