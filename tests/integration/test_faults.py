"""Reliability and security, second round (docs/reliability.md): every bad input, foreign file and
outside fault below reaches the real `grpo-run` command, which names the key, file or process involved."""

from tests.helpers import FAST, run_cli

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
