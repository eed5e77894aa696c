"""The Makefile: `make help` lists every documented target (digits in the name included); the threads and
pytest flags the targets run with."""

import os
import re
import shutil
import subprocess

import pytest

from tests.conftest import REPO


@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
def test_make_help_lists_every_documented_target():
    documented = re.findall(r"^([^\s:#]+):[^\n]*## ", (REPO / "Makefile").read_text(), flags=re.M)
    assert "bench-smollm2" in documented
    out = subprocess.run(["make", "-s", "help"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    listed = re.findall(r"^\s+(?:\x1b\[36m)?(\S+?)(?:\x1b\[0m)?\s", out, flags=re.M)
    assert listed == documented


def dry_run(*targets: str, **env: str) -> dict[str, str]:
    """The recipe line make would run for each target, its `install` prerequisite taken as done."""
    base = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    lines = {}
    for target in targets:
        out = subprocess.run(
            # --no-print-directory: under `make test` this make is a sub-make, which would say where it is
            ["make", "--no-print-directory", "-n", "-o", "install", target],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=True,
            env=base | env,
        ).stdout
        lines[target] = out.strip()
    return lines


def recipe_env(**env: str) -> str:
    """OMP_NUM_THREADS as a recipe of this Makefile sees it (exports included)."""
    base = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    probe = 'probe: ; @echo "[$${OMP_NUM_THREADS-unset}]"'
    return subprocess.run(
        ["make", "-s", "--eval", probe, "probe"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
        env=base | env,
    ).stdout.strip()


TRAINING_TARGETS = ("train", "demo", "sweep", "slurm-train", "slurm-sweep")


@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
def test_training_targets_use_every_core_unless_the_user_sets_threads():
    # Nothing exported: torch picks the machine's cores; a user's own setting passes through.
    assert recipe_env() == "[unset]"
    assert recipe_env(OMP_NUM_THREADS="3") == "[3]"
    for target, line in dry_run(*TRAINING_TARGETS).items():
        assert "grpo-run" in line and "OMP_NUM_THREADS" not in line, (target, line)


@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
def test_test_targets_run_on_one_thread_and_print_the_slowest_tests():
    for env in ({}, {"OMP_NUM_THREADS": "8"}):  # one thread even where the user's shell sets more
        lines = dry_run("test", "test-fast", **env)
        for target, line in lines.items():
            assert line.startswith("OMP_NUM_THREADS=1 "), (target, line)
            assert "-m pytest" in line and "--durations=20" in line, (target, line)
        assert lines["test-fast"].endswith("--ignore=tests/integration")
