"""Before Hydra configures logging: the run dir can be written, or one line says which folder and why.

Otherwise a read-only run dir ends in Hydra's "Unable to configure handler 'file'", which hides both.
"""

import os
import sys
import tempfile
from pathlib import Path


def requested_run_dir(argv: list[str]) -> Path:
    """The run dir an override names, or the default's root (outputs/) when it is computed by Hydra."""
    for arg in argv:
        key, _, value = arg.partition("=")
        if key.lstrip("+") == "hydra.run.dir" and value and "${" not in value:
            return Path(value.strip("'\""))
    return Path("outputs")


def check_writable(target: Path) -> str | None:
    """None when a file can be created in `target` (or in the folder that would hold it), else why not."""
    folder = target
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        fd, name = tempfile.mkstemp(dir=folder, prefix=".grpo-run-write-check-")
    except OSError as err:
        return f"cannot write the run dir {target.resolve()}: {err.strerror} ({folder.resolve()})"
    os.close(fd)
    os.unlink(name)
    return None


def exit_unless_writable(argv: list[str]) -> None:
    problem = check_writable(requested_run_dir(argv))
    if problem is not None:
        print(f"grpo-run: {problem}", file=sys.stderr)
        sys.exit(1)
