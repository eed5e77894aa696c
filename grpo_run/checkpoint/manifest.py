"""`manifest.json`: the size and sha256 of every other file of a checkpoint, written last, checked on resume."""

import hashlib
import json
from pathlib import Path

from grpo_run.checkpoint.files import write_json

MANIFEST = "manifest.json"


def write_manifest(folder: Path) -> None:
    files = {
        str(p.relative_to(folder)): {"size": p.stat().st_size, "sha256": _sha256(p)}
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != MANIFEST
    }
    write_json(folder / MANIFEST, {"version": 1, "files": files})


def manifest_damage(folder: Path) -> str | None:
    """None when every file the manifest lists is there with its size and checksum (or the checkpoint
    predates manifests), else what is wrong, naming the file."""
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


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
