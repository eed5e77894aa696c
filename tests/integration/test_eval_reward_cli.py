"""eval.reward through the real command on the tiny model: a user's own reward on data without gold answers
evaluated (eval/reward_mean with its interval, no eval/accuracy), the progress lines, mode=eval, the sweep
report reading it, a bad eval.reward exiting 2, and an exact resume."""

import json
from pathlib import Path

from grpo_run import checkpoint, trainer
from grpo_run import metrics as M
from grpo_run.tracking.report import main as report_main
from tests.builders import LEARN, config
from tests.helpers import FAST, read_metrics, run_cli

U = "tests.rewards.user_rewards"  # importable by the command: it runs in the repository root
REWARDS = f"reward.functions=[{{_target_: {U}.level_reward}}, {{_target_: {U}.length_reward, weight: 0.5}}]"
EVAL = ["eval.every_steps=2", "eval.num_prompts=6", "eval.batch_size=4"]


def no_gold_data(tmp_path: Path) -> list[str]:
    """A JSONL file with no answer column and a column of its own (`level`), as train and held-out split."""
    data = tmp_path / "levels.jsonl"
    data.write_text("".join(json.dumps({"question": f"Say {i}", "level": i % 2}) + "\n" for i in range(8)))
    return ["data=jsonl", f"data.train_path={data}", f"data.eval_path={data}", "data.answer_field=null"]


def test_a_user_reward_without_gold_is_evaluated_with_an_interval_and_reported(tmp_path):
    run_dir = tmp_path / "sweep" / "0"  # a job of a sweep dir, for grpo-run-report below
    proc, _ = run_cli([*FAST, *no_gold_data(tmp_path), REWARDS, *EVAL, f"hydra.run.dir={run_dir}"], tmp_path)
    rows = {r["step"]: r for r in read_metrics(run_dir)}
    for step in (0, 2):  # before and after training
        r = rows[step]
        assert M.EVAL_ACCURACY not in r and M.EVAL_MEAN_AT_K not in r  # no gold: no pass@1, no 0 standing in
        assert r[M.EVAL_REWARD_MEAN_CI_LOW] <= r[M.EVAL_REWARD_MEAN] <= r[M.EVAL_REWARD_MEAN_CI_HIGH]
        assert r["eval/rewards/level_reward_mean"] == 0.5  # 3 of the 6 held-out problems have level 1
        assert "eval/rewards/length_reward_mean_ci_low" in r
        total = r["eval/rewards/level_reward_mean"] + 0.5 * r["eval/rewards/length_reward_mean"]
        assert abs(r[M.EVAL_REWARD_MEAN] - total) < 1e-9  # no completion unscorable: the weighted sum
        assert r[M.EVAL_REWARD_UNSCORABLE] == 0 and r[M.EVAL_REWARD_ERRORS] == 0
    # The progress on the console (stderr), and the step line with the held-out reward.
    assert "held-out evaluation at step 0: default, 6 problems, completions: greedy only" in proc.stderr
    assert "eval default greedy: 4/6 problems" in proc.stderr and "eval default greedy: 6/6" in proc.stderr
    assert "eval reward " in proc.stderr
    summary = json.loads((run_dir / "eval_summary.json").read_text())
    assert M.EVAL_REWARD_MEAN + M.CI_LOW in summary["change"] and M.EVAL_ACCURACY not in summary["step 0"]

    # mode=eval on the run's final weights: the same greedy answers, the same reward as step 2's.
    evaluated = tmp_path / "evaluated"
    args = ["mode=eval", f"eval.checkpoint={run_dir}", *FAST, *no_gold_data(tmp_path), REWARDS, *EVAL]
    proc, _ = run_cli([*args, f"hydra.run.dir={evaluated}"], tmp_path)
    value = json.loads((evaluated / "eval_summary.json").read_text())["value"]
    assert value[M.EVAL_REWARD_MEAN] == rows[2][M.EVAL_REWARD_MEAN] and M.EVAL_ACCURACY not in value
    assert "held-out evaluation: default, 6 problems" in proc.stderr

    # grpo-run-report reads eval/reward_mean where eval/accuracy is absent.
    assert report_main([str(tmp_path / "sweep"), "--png", str(tmp_path / "report.png")]) == 0


def test_a_bad_eval_reward_exits_2_naming_the_key(tmp_path):
    proc, _ = run_cli([*FAST, *EVAL, "eval.reward=[{name: nope}]"], tmp_path, check=False)
    assert proc.returncode == 2 and "eval.reward[0].name='nope'" in proc.stderr
    missing = f"eval.reward=[{{_target_: {U}.no_such_function}}]"
    proc, run_dir = run_cli([*FAST, *EVAL, missing], tmp_path / "missing", check=False)
    assert proc.returncode == 2 and "eval.reward[0]._target_" in proc.stderr
    assert not (run_dir / "metrics.jsonl").exists()  # refused before any model loaded or step ran


def test_resume_logs_the_same_held_out_reward(tmp_path):
    args = [*LEARN, *no_gold_data(tmp_path), REWARDS, "trainer.max_steps=4", *EVAL]
    whole = tmp_path / "whole"
    trainer.train(config([*args, "checkpoint.every_steps=1", "checkpoint.keep_last=4"], whole))
    resumed = tmp_path / "resumed"
    trainer.train(
        config([*args, f"resume={whole / checkpoint.CHECKPOINTS / checkpoint.step_name(2)}"], resumed)
    )

    def timeless(rows):
        return [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in rows]

    first, second = read_metrics(whole), read_metrics(resumed)
    assert [r["step"] for r in second] == [3, 4] and M.EVAL_REWARD_MEAN in second[-1]
    assert timeless(second) == timeless(first)[-2:]  # step 4's eval/reward_mean and its interval among them
