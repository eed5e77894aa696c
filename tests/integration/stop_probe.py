"""`grpo-run` in this process, with one function of the package wrapped so that its n-th call touches a
marker file and then waits (up to 120 s) until the process was asked to stop: a test waits for the file,
sends its signal, and the phase then runs from its start with the stop pending, as a signal arriving at
its first decode step, reward call or micro-batch would find it.

    python -m tests.integration.stop_probe MARKER module:function N -- <grpo-run overrides>
    python -m tests.integration.stop_probe MARKER module:Class.method N -- <grpo-run overrides>

Nothing else in the run is changed.
"""

import importlib
import sys
import time
from pathlib import Path

HOLD_S = 120.0


def wrap(target: str, nth: int, marker: Path) -> None:
    from grpo_run.safety.stop import stop_requested

    module_name, path = target.split(":")
    owner = importlib.import_module(module_name)
    *outer, name = path.split(".")
    for part in outer:
        owner = getattr(owner, part)
    original = getattr(owner, name)
    calls = 0

    def wrapped(*args, **kwargs):
        nonlocal calls
        calls += 1
        if calls == nth:
            marker.touch()
            deadline = time.monotonic() + HOLD_S
            while not stop_requested() and time.monotonic() < deadline:
                time.sleep(0.02)
        return original(*args, **kwargs)

    setattr(owner, name, wrapped)


def main() -> None:
    marker, target, nth, dashes, *overrides = sys.argv[1:]
    assert dashes == "--", sys.argv
    if target != "-":  # "-": the phase marks itself (a test's slow reward)
        wrap(target, int(nth), Path(marker))
    from grpo_run.cli import main as cli_main

    sys.argv = ["grpo-run", *overrides]
    cli_main()


if __name__ == "__main__":
    main()
