"""A user's reward through a whole run on the tiny model: TRL-form functions by `_target_`, weights, GDPO,
failures counted, exact resume, a bad target refused before any model loads, a user's own config folder."""

import json
import textwrap
from pathlib import Path

import torch
from safetensors.torch import load_file

from grpo_run import checkpoint, trainer
from grpo_run import metrics as M
from tests.builders import LEARN, QUIET, config
from tests.helpers import FAST, read_metrics, run_cli

U = "tests.rewards.user_rewards"
# Two user functions and a built-in: the share of "a" (a class built with its kwargs, ranged), one that
# raises on completions holding "b" (counted, never fatal), and format.
REWARDS = (
    f"reward.functions=[{{_target_: {U}.CountsA, kwargs: {{letter: a}}, range: [0, 1]}},"
    f" {{_target_: {U}.raises_on_b, weight: 0.5}}, {{name: format, weight: 0.1}}]"
)


def test_user_functions_train_with_weights_and_count_their_failures(tmp_path):
    run_dir = tmp_path / "run"
    trainer.train(config([*FAST, *QUIET, REWARDS, "trainer.max_steps=3"], run_dir))
    rows = read_metrics(run_dir)
    assert len(rows) == 3 and (run_dir / "final" / "model.safetensors").exists()
    for r in rows:
        assert 0 <= r["train/rewards/CountsA_mean"] <= 1
        assert r[M.REWARD_ERRORS] == r["train/rewards/raises_on_b_errors"]
        assert r["train/rewards/CountsA_errors"] == 0 and r["train/rewards/format_errors"] == 0
        # an error scores 0: raises_on_b's mean is the share of completions it did not fail on (8 a step)
        assert r["train/rewards/raises_on_b_mean"] == (8 - r[M.REWARD_ERRORS]) / 8
        # no range on raises_on_b: the weighted total's bounds are unknown, so no all-correct split
        assert M.FRAC_ALL_CORRECT not in r and M.FRAC_REWARD_ZERO_STD in r
    assert sum(r[M.REWARD_ERRORS] for r in rows) > 0  # the tiny model writes "b" now and then


def test_gdpo_normalize_then_sum_on_user_functions(tmp_path):
    run_dir = tmp_path / "run"
    rewards = f"reward.functions=[{{_target_: {U}.CountsA}}, {{_target_: {U}.length_reward, weight: 0.5}}]"
    trainer.train(config([*FAST, *QUIET, rewards, "reward.aggregation=normalize_then_sum"], run_dir))
    rows = read_metrics(run_dir)
    assert len(rows) == 2 and all(r[M.REWARD_ERRORS] == 0 for r in rows)
    assert all("train/rewards/length_reward_mean" in r for r in rows)


def test_resume_with_a_user_reward_is_bitwise_identical(tmp_path):
    args = [*LEARN, REWARDS, "trainer.max_steps=4"]
    whole = tmp_path / "whole"
    trainer.train(config([*args, "checkpoint.every_steps=1", "checkpoint.keep_last=4"], whole))
    resumed = tmp_path / "resumed"
    trainer.train(
        config([*args, f"resume={whole / checkpoint.CHECKPOINTS / checkpoint.step_name(2)}"], resumed)
    )

    def timeless(rows):
        return [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in rows]

    assert [r["step"] for r in read_metrics(resumed)] == [3, 4]
    assert timeless(read_metrics(resumed)) == timeless(read_metrics(whole))[2:]
    a, b = (
        load_file(whole / "final" / "model.safetensors"),
        load_file(resumed / "final" / "model.safetensors"),
    )
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_bad_target_exits_2_naming_the_key_before_any_model_loads(tmp_path):
    # model.path is a hub id cached nowhere: had the model loaded first, the error would be about it
    args = [
        "model=local",
        "model.path=no-such-org/no-model",
        f"reward.functions=[{{_target_: {U}.no_kwargs}}]",
    ]
    proc, _ = run_cli([*args, "logger=console"], tmp_path, check=False)
    assert proc.returncode == 2, proc.stderr
    assert "reward.functions[0]._target_" in proc.stderr and "**kwargs" in proc.stderr
    assert "no-model" not in proc.stderr


def _user_project(root: Path) -> Path:
    """A user's own package and Hydra config folder, outside grpo-run's tree."""
    (root / "my_rewards").mkdir(parents=True)
    (root / "my_rewards" / "__init__.py").write_text(
        textwrap.dedent(
            '''
            def share_of_a(completions, **kwargs):
                """Written for TRL's GRPOTrainer: the share of "a" in each completion."""
                return [c.count("a") / max(len(c), 1) for c in completions]
            '''
        )
    )
    conf = root / "conf"
    (conf / "reward").mkdir(parents=True)
    (conf / "experiment").mkdir()
    (conf / "reward" / "share_of_a.yaml").write_text(
        "functions:\n  - _target_: my_rewards.share_of_a\n    range: [0, 1]\n"
    )
    (conf / "experiment" / "my_tiny.yaml").write_text(
        textwrap.dedent(
            """\
            # @package _global_
            defaults:
              - override /model: tiny
              - override /reward: share_of_a
            trainer:
              max_steps: 2
              prompts_per_step: 2
              micro_batch_size: 4
              device: cpu
              lr_scheduler: constant
            grpo:
              group_size: 4
            generation:
              max_new_tokens: 8
            eval:
              every_steps: 0
            """
        )
    )
    return conf


def test_a_users_own_package_and_config_folder(tmp_path):
    conf = _user_project(tmp_path / "project")
    env = {"PYTHONPATH": str(tmp_path / "project")}
    for i, how in enumerate((["--config-dir", str(conf)], [f"hydra.searchpath=[file://{conf}]"])):
        run_dir = tmp_path / f"run{i}"
        run_cli([*how, "experiment=my_tiny", "logger=console", f"hydra.run.dir={run_dir}"], tmp_path, env=env)
        rows = read_metrics(run_dir)
        assert len(rows) == 2 and all("train/rewards/share_of_a_mean" in r for r in rows)
        assert all(M.FRAC_ALL_CORRECT in r for r in rows)  # its range makes the split known
        assert all(r[M.REWARD_ERRORS] == 0 for r in rows)


def test_columns_ids_and_step_reach_a_user_function_in_a_run(tmp_path):
    """A JSONL file with a column of its own (`level`): each completion's reward is its example's level."""
    data = tmp_path / "levels.jsonl"
    records = [{"question": f"Say {i}", "answer": str(i), "level": i % 2} for i in range(6)]
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    rewards = f"reward.functions=[{{_target_: {U}.level_reward}}, {{_target_: {U}.ids_agree, weight: 0}}]"
    run_dir = tmp_path / "run"
    overrides = [*FAST, *QUIET, rewards, "data=jsonl", f"data.train_path={data}", "trainer.max_steps=3"]
    trainer.train(config(overrides, run_dir))
    for r in read_metrics(run_dir):
        assert r[M.REWARD_ERRORS] == 0
        assert r["train/rewards/ids_agree_mean"] == 1.0
        assert r["train/rewards/level_reward_mean"] in (0.0, 0.5, 1.0)  # 2 prompts a step, each level 0 or 1


def test_a_conversational_column_gives_chat_prompts_and_message_completions(tmp_path):
    data = tmp_path / "chats.jsonl"
    turns = [{"role": "system", "content": "Answer with a."}, {"role": "user", "content": "Go"}]
    data.write_text("".join(json.dumps({"prompt": turns, "answer": "a"}) + "\n" for _ in range(4)))
    rewards = f"reward.functions=[{{_target_: {U}.chat_contains_a}}]"
    run_dir = tmp_path / "run"
    overrides = [
        *FAST,
        *QUIET,
        rewards,
        "data=jsonl",
        f"data.train_path={data}",
        "data.messages_field=prompt",
    ]
    trainer.train(config(overrides, run_dir))
    assert all(r[M.REWARD_ERRORS] == 0 for r in read_metrics(run_dir))  # completions came as message lists


def test_complementary_none_functions_train_on_the_other_functions_value(tmp_path):
    # A multi-task pair written for TRL: each None where the other applies. Every completion has a reward.
    run_dir = tmp_path / "run"
    rewards = f"reward.functions=[{{_target_: {U}.plus_only}}, {{_target_: {U}.not_plus}}]"
    ops = "data.arithmetic.operations=[+,-]"
    trainer.train(config([*FAST, *QUIET, rewards, ops, "trainer.max_steps=3"], run_dir))
    rows = read_metrics(run_dir)
    assert len(rows) == 3
    assert all(r[M.REWARD_UNSCORABLE] == 0 and r[M.REWARD_ERRORS] == 0 for r in rows)
    assert all(r[M.REWARD_FAILED_FRACTION] == 0 for r in rows)
    assert any(r[M.GRAD_NORM] > 0 for r in rows)  # groups with a spread of rewards trained


def test_a_reward_that_fails_every_step_ends_the_run_with_exit_1(tmp_path):
    args = [*FAST, "logger=console", f"reward.functions=[{{_target_: {U}.always_raises}}]"]
    proc, run_dir = run_cli(
        [*args, "trainer.max_steps=6", "reward.max_failed_steps=2"], tmp_path, check=False
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    last = (proc.stdout + proc.stderr).strip().splitlines()[-1]
    assert "no reward function scored any completion for 2 steps in a row" in last
    assert "reward.max_failed_steps=2" in last
    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2]
    assert all(r[M.REWARD_FAILED_FRACTION] == 1.0 for r in read_metrics(run_dir))

    never = tmp_path / "never"
    never.mkdir()
    proc, run_dir = run_cli([*args, "trainer.max_steps=3", "reward.max_failed_steps=0"], never)
    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2, 3]


def test_a_parameter_no_column_fills_exits_2_when_the_data_loads(tmp_path):
    base = [*FAST, "logger=console"]
    for target, named in (("needs_solution", "'solution'"), ("singular_completion", "'completion'")):
        proc, _ = run_cli([*base, f"reward.functions=[{{_target_: {U}.{target}}}]"], tmp_path, check=False)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        out = proc.stdout + proc.stderr
        assert f"reward.functions[0]._target_='{U}.{target}'" in out and named in out
        assert "columns: answer, question" in out
    assert "did you mean 'completions'?" in out
