"""`grpo-run` with difficulty buckets (data.arithmetic.mix) and eval.group_by=difficulty on the tiny model:
metrics.jsonl holds the per-bucket held-out and training keys, the per-problem file each problem's
bucket, grpo-run-report draws one panel per bucket; a held-out set without the column exits 2."""

import json

from grpo_run import metrics as M
from grpo_run.tracking.bucket_curves import BUCKETS_PNG, buckets_figure
from grpo_run.tracking.report import load_sweep, main
from tests.helpers import read_metrics, run_cli

MIX = "data.arithmetic.mix=[{name:easy,share:0.5},{name:hard,share:0.5,operations:[*],min_digits:2}]"
RUN = [
    "debug=smoke",
    "logger=console",
    "data.train_size=40",
    "data.eval_size=8",
    "eval.num_prompts=8",
    "eval.max_new_tokens=4",
    # Every model turn is answered: every episode calls the tool, in every bucket.
    "env.name=always",
    "+env._target_=tests.envs.toy.AlwaysAnswers",
    "env.max_turns=2",
    "env.max_total_tokens=40",
]


def test_a_mix_run_logs_the_bucket_keys_and_the_report_draws_them(tmp_path):
    _, run_dir = run_cli([*RUN, MIX, "eval.group_by=difficulty"], tmp_path)
    rows = read_metrics(run_dir)
    evals = [r for r in rows if M.EVAL_S in r]
    assert [r["step"] for r in evals] == [0, 2]
    for row in evals:
        assert row["eval/num_problems/easy"] + row["eval/num_problems/hard"] == 8
        for name in ("easy", "hard"):
            assert 0.0 <= row[f"eval/pass@1/{name}"] <= 1.0 and f"eval/pass@1/{name}_ci_low" in row
            assert row[f"eval/tool_call_rate/{name}"] == 1.0 and row[f"eval/calls_per_episode/{name}"] >= 1.0
        assert row[M.EVAL_CALLS_PER_EPISODE] >= 1.0
    for row in (r for r in rows if M.REWARD_MEAN in r):  # the training steps
        rates = {k: v for k, v in row.items() if k.startswith("train/tool_call_rate/")}
        assert rates and set(rates.values()) == {1.0}
        assert {k.replace("tool_call_rate", "reward_mean") for k in rates} <= set(row)
    problems = json.loads((run_dir / "eval_problems" / "step_2.json").read_text())["default"]
    assert sorted(set(problems["groups"])) == ["easy", "hard"] and min(problems["tool_calls"]) >= 1
    assert main([str(run_dir)]) == 0
    _, axes = buckets_figure(load_sweep(run_dir))
    assert len(axes) == 2 and (run_dir / BUCKETS_PNG).exists()


def test_a_held_out_set_without_the_column_exits_2(tmp_path):
    proc, _ = run_cli([*RUN, "eval.group_by=difficulty"], tmp_path, check=False)  # no mix: no column
    assert proc.returncode == 2, proc.stderr
    assert "eval.group_by='difficulty'" in proc.stderr and "arithmetic-eval-" in proc.stderr


def test_a_bucket_too_small_for_the_sizes_exits_2_naming_them(tmp_path):
    # 81 distinct sums of two 1-digit numbers; the easy half of 200 + 8 asks for 104 of them.
    small = "data.arithmetic.mix=[{name:easy,share:0.5,operations:[+],max_digits:1,word_problem_fraction:0},{name:hard,share:0.5}]"
    proc, _ = run_cli([*RUN, small, "data.train_size=200"], tmp_path, check=False)
    assert proc.returncode == 2, proc.stderr
    assert "in bucket 'easy'" in proc.stderr and "data.train_size" in proc.stderr
    assert "Traceback" not in proc.stderr
