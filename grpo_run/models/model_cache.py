"""Model folders built once into `model.cache_dir` (the tiny model, SmolLM2 converted from its GGUF).

A folder is written in a temporary sibling and renamed into place, so concurrent builders (the ranks of
a multi-GPU run, parallel sweep jobs) never see half a folder, and is published only when it holds a
config and weights: transformers' `save_pretrained` silently writes no weights on a rank > 0 once
torch.distributed is initialised, and such a folder, renamed into place, broke the cache for everyone.
"""

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


class ModelCacheError(RuntimeError):
    """A cached model folder is incomplete, or building one wrote no weights."""


def is_complete(folder: Path) -> bool:
    return (folder / "config.json").is_file() and any(folder.glob("*.safetensors"))


def ensure_model_folder(cache_dir: str | os.PathLike, name: str, write: Callable[[Path], None]) -> Path:
    """`cache_dir/name`, built by `write(folder)` when absent; every process gets the same complete folder."""
    target = Path(cache_dir).expanduser() / name
    # exists() first: a folder appears whole (a rename), so one that exists is complete or never will be;
    # asking is_complete first raced a builder publishing between the two checks.
    if target.exists():
        if is_complete(target):
            return target
        raise ModelCacheError(
            f"{target}: an incomplete model folder (no config.json or no weights); delete it"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
    try:
        write(tmp)
        if not is_complete(tmp):
            raise ModelCacheError(
                f"building {name} in {tmp} wrote no config.json or no *.safetensors (is torch.distributed "
                "initialised on a rank > 0? build the cache before joining the ranks)"
            )
        try:
            os.rename(tmp, target)
        except OSError:  # another process published it first: theirs is identical
            if not is_complete(target):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
