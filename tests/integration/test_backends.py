"""The two backends through the real `grpo-run`: `backend=plain` needs nothing of the fast path (a copy of
the package without grpo_run/native/ trains and evaluates), and both backends learn the same thing."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.builders import run_here
from tests.helpers import FAST, REPO, read_metrics

pytestmark = pytest.mark.slow

# `grpo-run` from the copy only: an editable install's finder would otherwise supply any module the copy
# lacks from the checkout (it answers for every `grpo_run.*` name before the path is searched).
LAUNCH = (
    "import runpy, sys; "
    "sys.meta_path[:] = [f for f in sys.meta_path if '__editable__' not in getattr(f, '__module__', '')]; "
    "sys.argv[0] = 'grpo-run'; runpy.run_module('grpo_run.cli', run_name='__main__')"
)


def copy_without_native(tmp_path: Path) -> Path:
    copy = tmp_path / "repo"
    shutil.copytree(REPO / "grpo_run", copy / "grpo_run", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(REPO / "conf", copy / "conf")
    shutil.rmtree(copy / "grpo_run" / "native")
    return copy


def run_copy(copy: Path, args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", LAUNCH, *args],
        cwd=copy,
        env={**os.environ, "PYTHONPATH": str(copy)},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_a_plain_run_works_without_the_fast_package(tmp_path):
    run_dir = tmp_path / "run"
    args = [*FAST, "backend=plain", "eval.every_steps=2", "eval.num_prompts=4", "eval.batch_size=4"]
    proc = run_copy(copy_without_native(tmp_path), [*args, f"hydra.run.dir={run_dir}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert "eval/accuracy" in rows[-1] and "train/loss" in rows[-1]
    assert (run_dir / "final" / "config.json").exists()


def test_the_default_backend_needs_the_fast_package(tmp_path):
    """The same copy with the default backend fails at once naming the missing module: the loop reached the
    fast path only through grpo_run/backend.py."""
    proc = run_copy(copy_without_native(tmp_path), [*FAST, f"hydra.run.dir={tmp_path / 'run'}"])
    assert proc.returncode != 0
    assert "grpo_run.native" in proc.stderr


@pytest.mark.parametrize("backend", ["native", "plain"])
def test_each_backend_trains_the_tiny_model(tmp_path, backend):
    # In this process: what is under test is each backend's training, not the command.
    args = [*FAST, "logger=console", f"backend={backend}", "trainer.max_steps=3"]
    rows = read_metrics(run_here(args, tmp_path / "run"))
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["train/grad_norm"] > 0 for r in rows)


def test_plain_and_native_forwards_give_the_same_first_loss(tmp_path):
    """Step 1's rollout comes from the same weights and noise, so its samples, rewards and loss agree
    (float32 weights: the native forward equals transformers' to rounding)."""
    common = [*FAST, "logger=console", "trainer.max_steps=1", "backend.bf16_sampling_copy=false"]
    native = read_metrics(run_here([*common, "backend=native"], tmp_path / "a" / "run"))
    plain = read_metrics(run_here([*common, "backend=plain"], tmp_path / "b" / "run"))
    assert native[0]["train/reward_mean"] == plain[0]["train/reward_mean"]
    assert native[0]["train/loss"] == pytest.approx(plain[0]["train/loss"], rel=1e-4, abs=1e-7)
    assert Path(tmp_path / "a" / "run" / "final").exists()
