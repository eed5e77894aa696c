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


def test_a_log_file_keeps_every_line_whole(tmp_path):
    """stderr to a file (as under Slurm or `2>log`): the run-dir lines, longer than rich's 80 columns, are
    each one line, so the path can be copied from the log."""
    run_dir = tmp_path / ("a-run-dir-longer-than-a-terminal-line-" * 4) / "run"
    proc, _ = run_cli([*FAST, f"hydra.run.dir={run_dir}"], tmp_path)
    lines = proc.stderr.splitlines()
    assert f"grpo-run run dir: {run_dir}" in lines, proc.stderr
    assert f"done run dir: {run_dir}" in lines, proc.stderr
    steps = [line for line in lines if line.startswith("step ")]
    assert len(steps) == 2 and all(line.endswith("tok/s") for line in steps), steps


def test_a_teacher_path_that_names_nothing_exits_2_naming_its_key_before_any_model_loads(tmp_path):
    missing = tmp_path / "no-such-teacher"
    proc, run_dir = run_cli(
        [*FAST, "distill=teacher", f"distill.teacher.path={missing}"], tmp_path, check=False
    )
    assert proc.returncode == 2, proc.stderr
    assert f"distill.teacher.path='{missing}': names no folder" in proc.stderr, proc.stderr
    assert "model.path" not in proc.stderr and "cannot load model" not in proc.stderr
    assert not (run_dir / "config_resolved.yaml").exists()  # refused at the door, before the run began


def test_a_gold_answer_reward_on_data_without_answers_exits_2_naming_both_keys(tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text('{"question": "1+1?"}\n')
    args = [*FAST, "reward=math_verifier", "data=jsonl", f"data.train_path={data}", "data.answer_field=null"]
    proc, _ = run_cli(args, tmp_path, check=False)
    assert proc.returncode == 2, proc.stderr
    assert "reward.functions[0].name='math_verifier'" in proc.stderr and "data.answer_field" in proc.stderr
