"""A fresh run directory per run, claimed with one atomic `mkdir`.

`conf/config.yaml` names the default run (and sweep) directory `${fresh_dir:outputs/runs/<date>/<time>}`.
A timestamp alone is not enough: on a machine whose clock ticks coarsely, two runs started together
read the same microsecond and would write one directory's checkpoints (seen in CI). `os.mkdir` either
creates the directory or fails, so of two processes asking for one name exactly one gets it; the
other takes `<name>-1`, `<name>-2`, ...
"""

import os
import shutil
from pathlib import Path

from omegaconf import OmegaConf

RESOLVER = "fresh_dir"
MAX_SUFFIX = 1000

# base -> the directory this process claimed for it. Hydra resolves `hydra.run.dir` more than once
# (and its resolver cache travels with a multirun's job configs), so a second call returns the first claim.
_claimed: dict[str, str] = {}


def claim_fresh_dir(base: str) -> str:
    """Create `base` (or the first free `base-N`) and return it; the same answer on every call for `base`."""
    if base in _claimed:
        return _claimed[base]
    Path(base).parent.mkdir(parents=True, exist_ok=True)
    for n in range(MAX_SUFFIX):
        path = base if n == 0 else f"{base}-{n}"
        try:
            os.mkdir(path)
        except FileExistsError:
            continue
        _claimed[base] = path
        return path
    raise FileExistsError(f"{base}: it and {base}-1 ... {base}-{MAX_SUFFIX - 1} all exist already")


def claimed_here(path: str) -> bool:
    """Whether this process created `path` through `claim_fresh_dir` (so it holds only what we put there)."""
    return os.path.abspath(path) in {os.path.abspath(p) for p in _claimed.values()}


def give_up_claim(path: str) -> None:
    """Remove a directory this process claimed and no longer uses (Hydra's `.hydra/` and log only).

    A rank > 0 under torchrun or srun claims a directory of its own before it learns rank 0's, and
    so does the command of a node > 0 before it starts its ranks; all of them train in rank 0's, and
    their own would be empty leftovers. Directories named by the user are kept.
    """
    if claimed_here(path):
        shutil.rmtree(path, ignore_errors=True)


def register_resolver() -> None:
    # use_cache: Hydra copies resolver caches into each multirun job's config (and pickles them to
    # submitit's workers), so every job of one sweep resolves the same sweep directory.
    OmegaConf.register_new_resolver(RESOLVER, claim_fresh_dir, use_cache=True, replace=True)
