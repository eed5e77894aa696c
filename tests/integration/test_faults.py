"""Reliability and security, second round (docs/reliability.md): every bad input, foreign file and
outside fault below reaches the real `grpo-run` command, which names the key, file or process involved."""

import pytest

import grpo_run.trainer as trainer
from tests.helpers import FAST, run_cli
from tests.integration.test_reliability import LEARN, config, inject_nan_loss

QUIET = ["logger=console", "logger.console=false"]


def last_line(proc) -> str:
    return (proc.stdout + proc.stderr).strip().splitlines()[-1]


def test_cuda_without_a_gpu_exits_2_naming_the_key_and_what_torch_sees(tmp_path):
    # CUDA_VISIBLE_DEVICES="" hides any GPU, so this holds on a GPU machine too.
    proc, run_dir = run_cli(
        [*FAST, *QUIET, "trainer.device=cuda"], tmp_path, check=False, env={"CUDA_VISIBLE_DEVICES": ""}
    )
    assert proc.returncode == 2, proc.stderr
    assert "trainer.device='cuda'" in proc.stderr
    assert "torch sees no CUDA device" in proc.stderr
    assert not (run_dir / "config_resolved.yaml").exists()  # nothing ran


def test_the_nan_stop_says_what_checkpoint_exists(tmp_path, monkeypatch):
    """With no checkpoint saved yet, the message says so instead of promising finite weights."""
    inject_nan_loss(monkeypatch, lambda step: step >= 1)
    overrides = [*LEARN, "trainer.max_steps=4", "trainer.max_consecutive_nonfinite=2"]
    with pytest.raises(trainer.NonFiniteError, match="no checkpoint was saved") as err:
        trainer.train(config(overrides, tmp_path / "none"))
    assert "holds finite weights" not in str(err.value)
    saved = [*overrides, "checkpoint.every_steps=1", "trainer.max_consecutive_nonfinite=3"]
    # Steps 1-3 NaN (still injected): steps 1 and 2 are saved (streaks 1, 2), step 3 stops unsaved.
    with pytest.raises(trainer.NonFiniteError, match=r"step_00000002 \(step 2\), holds finite weights"):
        trainer.train(config(saved, tmp_path / "saved"))
