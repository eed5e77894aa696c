"""The first minutes through the real `grpo-run` command: a TRL name, a model path that names nothing, a
gold-answer reward without gold answers all exit 2 naming the key, and a log file's lines are whole."""

import pytest

from tests.helpers import FAST, run_cli


@pytest.mark.parametrize(
    "override,said",
    [
        # Hydra refuses it: the key under a section
        (
            "trainer.learning_rate=1e-5",
            "trainer.learning_rate is TRL's GRPOConfig name; did you mean trainer.lr?",
        ),
        # the door refuses it: added at the root with +
        ("+num_generations=8", "num_generations is TRL's GRPOConfig name; did you mean grpo.group_size?"),
        # a TRL setting grpo-run has no counterpart for
        (
            "grpo.sync_ref_model=true",
            "grpo.sync_ref_model is TRL's GRPOConfig name; grpo-run does not offer it",
        ),
    ],
)
def test_a_trl_name_exits_2_with_our_key(tmp_path, override, said):
    proc, run_dir = run_cli([*FAST, override], tmp_path, check=False)
    assert proc.returncode == 2, proc.stderr
    assert said in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (run_dir / "metrics.jsonl").exists()
