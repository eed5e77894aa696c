"""`grpo-run data=hub` through the command on TRL-style files: no keys needed, a one-split file carved for
evaluation with one console line, and a key naming a column that is not there: exit 2 before any model."""

import json

from tests.helpers import FAST, read_metrics, run_cli

ROWS = [
    {"prompt": [{"role": "user", "content": f"What is {i} + {i}?"}], "solution": str(2 * i)} for i in range(6)
] + [{"prompt": f"What is {i} + 1?", "solution": str(i + 1)} for i in range(6)]
REWARD = "reward.functions=[{_target_: tests.data.trl_rewards.mentions_solution, range: [0, 1]}]"


def write_rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_trl_style_file_needs_no_keys(tmp_path):
    path = write_rows(tmp_path / "trl.jsonl", ROWS)
    args = [*FAST, "data=hub", f"data.dataset={path}", REWARD, "data.eval_size=4"]
    args += ["eval.every_steps=2", "eval.num_prompts=2", "eval.samples_per_prompt=2"]
    proc, run_dir = run_cli(args, tmp_path, env={"HF_DATASETS_CACHE": str(tmp_path / "hf")})
    out = proc.stdout + proc.stderr
    line = f"data: {path} has one split, 'train', and no data.eval_split='test': 4 of its 12 records are held"
    assert line in out and "8 trained on" in out, out
    rows = [r for r in read_metrics(run_dir) if "train/rewards/mentions_solution_mean" in r]
    assert len(rows) == 2


def test_a_column_that_is_not_there_exits_2_before_any_model(tmp_path):
    path = write_rows(tmp_path / "sums.jsonl", [{"problem": "1 + 1?", "solution": "2"}] * 4)
    cache = tmp_path / "grpo-cache"
    env = {"HF_DATASETS_CACHE": str(tmp_path / "hf"), "GRPO_RUN_CACHE": str(cache)}
    proc, _ = run_cli([*FAST, "data=hub", f"data.dataset={path}", REWARD], tmp_path, check=False, env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    lines = [line for line in out.splitlines() if "data.question_field" in line]
    assert lines == [
        f"grpo-run: invalid config: data.question_field='prompt' is not a column of {path} split 'train' "
        "(columns: problem, solution): data.question_field=problem"
    ], out
    assert "Traceback" not in out and not any(cache.glob("*/config.json"))  # no model was built
