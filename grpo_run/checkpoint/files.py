"""Small file helpers the checkpoint modules share: JSON, atomic text replacement, fsync."""

import json
import os
from pathlib import Path
from typing import Any


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=1) + "\n")


def write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    fsync_file(tmp)
    os.replace(tmp, path)


def fsync_file(path: Path) -> None:
    """Flush a file (or a folder's entries) to disk, so a power cut cannot undo a rename's contents."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(folder: Path) -> None:
    for path in sorted(folder.rglob("*"), reverse=True):
        fsync_file(path)
    fsync_file(folder)
