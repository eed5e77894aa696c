"""eval.group_by: per-value (difficulty bucket) held-out metrics on known scores and on a scripted
environment with known tool calls, the per-problem file's buckets and calls, the paired per-bucket change,
and the load-time error for an example without the column."""

import re

import pytest
import torch

from grpo_run import metrics as M
from grpo_run.algo.intervals import wilson_interval
from grpo_run.backend import generation_engine
from grpo_run.config import ConfigError
from grpo_run.data import Example
from grpo_run.envs.registry import build_environment
from grpo_run.evaluation.held_out import EvalInputs, evaluate_problems
from grpo_run.evaluation.report import bucket_keys, of_set, results_table
from grpo_run.evaluation.stats import ProblemScores, paired_change, read_problems, summarize, write_problems
from grpo_run.models.loading import load_model, load_tokenizer
from grpo_run.run_context import load_examples
from grpo_run.scoring import RewardPool
from tests.builders import compose_config


def _scores(greedy, groups, calls=None) -> ProblemScores:
    n = len(greedy)
    return ProblemScores(
        ids=[f"p{i}" for i in range(n)],
        greedy=greedy,
        sampled=[[g] for g in greedy],
        boxed=[1.0] * n,
        lengths=[5] * n,
        groups=groups,
        tool_calls=calls,
    )


def test_per_bucket_keys_on_known_scores():
    # easy: 3 problems, 2 right (one gold unparsable, out of the count); hard: 2 problems, 0 right.
    scores = _scores(
        [1.0, 1.0, 0.0, None, 0.0], ["easy", "easy", "hard", "easy", "hard"], calls=[0, 0, 2, 1, 3]
    )
    out = summarize(scores)
    assert out["eval/pass@1/easy"] == 1.0 and out["eval/num_problems/easy"] == 2.0
    assert out["eval/pass@1/hard"] == 0.0 and out["eval/num_problems/hard"] == 2.0
    assert (out["eval/pass@1/easy_ci_low"], out["eval/pass@1/easy_ci_high"]) == wilson_interval(2, 2)
    # calls: easy [0, 0, 1] -> 1 of 3 episodes called, 1/3 calls each; hard [2, 3] -> 2 of 2, 2.5 calls
    assert out["eval/tool_call_rate/easy"] == pytest.approx(1 / 3)
    assert (
        out["eval/tool_call_rate/easy_ci_low"],
        out["eval/tool_call_rate/easy_ci_high"],
    ) == wilson_interval(1, 3)
    assert out["eval/tool_call_rate/hard"] == 1.0
    assert out["eval/calls_per_episode/easy"] == pytest.approx(1 / 3)
    assert out["eval/calls_per_episode/hard"] == 2.5
    assert (
        2.0
        <= out["eval/calls_per_episode/hard_ci_low"]
        <= 2.5
        <= out["eval/calls_per_episode/hard_ci_high"]
        <= 3.0
    )
    assert out[M.EVAL_CALLS_PER_EPISODE] == pytest.approx(6 / 5)  # every problem's episode
    # An eval.datasets set's keys carry its name; without an environment there are no call keys.
    named = summarize(_scores([1.0, 0.0], ["a", "b"]), "hard_set")
    assert named["eval/hard_set/pass@1/a"] == 1.0 and named["eval/hard_set/num_problems/b"] == 1.0
    assert not [k for k in named if "tool_call_rate" in k or "calls_per_episode" in k]
    # No grouping: none of the per-value keys.
    assert not [k for k in summarize(_scores([1.0], None)) if "@1" in k or k.count("/") > 1]


def test_the_problem_file_keeps_buckets_and_calls_and_the_change_is_paired_per_bucket(tmp_path):
    before = _scores([0.0, 0.0, 1.0, 0.0], ["easy", "easy", "hard", "hard"], calls=[0, 0, 0, 0])
    after = _scores([1.0, 1.0, 0.0, 1.0], ["easy", "easy", "hard", "hard"], calls=[0, 0, 1, 2])
    write_problems(tmp_path, 0, {"default": before})
    write_problems(tmp_path, 5, {"default": after})
    read = read_problems(tmp_path, 5)["default"]
    assert read.groups == after.groups and read.tool_calls == [0, 0, 1, 2]
    change = paired_change(read_problems(tmp_path, 0)["default"], read)
    assert change["eval/pass@1/easy_flips_up"] == 2.0 and change["eval/pass@1/easy_flips_down"] == 0.0
    assert change["eval/pass@1/hard_flips_up"] == 1.0 and change["eval/pass@1/hard_flips_down"] == 1.0
    assert change["eval/pass@1/easy_ci_low"] == change["eval/pass@1/easy_ci_high"] == 1.0  # both went up


def test_the_report_table_has_a_row_per_bucket():
    values = summarize(_scores([1.0, 0.0], ["easy", "hard"], calls=[0, 1]))
    own = of_set(values, None)  # the run's own set keeps its per-bucket keys
    assert "eval/pass@1/easy" in own and "eval/tool_call_rate/hard" in own
    keys = bucket_keys({"step 0": own})
    assert keys[:2] == ["eval/pass@1/easy", "eval/pass@1/hard"] and "eval/calls_per_episode/hard" in keys
    table = results_table("t", {"step 0": own}, 1, 2)
    assert "eval/pass@1/easy" in table.columns[0]._cells


def test_a_scripted_environment_gives_known_calls_per_bucket():
    cfg = compose_config(
        [
            "model=tiny",
            "trainer.device=cpu",
            "eval.every_steps=0",
            "eval.samples_per_prompt=1",
            "eval.max_new_tokens=2",
            "eval.group_by=difficulty",
            "env.name=scripted",
            "+env._target_=tests.envs.toy.CallsFromColumn",
            "env.max_turns=4",
        ]
    )
    calls = {"easy": [0, 0, 1], "hard": [2, 3]}
    examples = [
        Example(f"What is {i} + 1?", str(i + 1), f"{name}-{i}", {"difficulty": name, "calls": c})
        for name, counts in calls.items()
        for i, c in enumerate(counts)
    ]
    tokenizer = load_tokenizer(cfg.model)
    model = load_model(cfg.model, torch.device("cpu"), trainable=True)
    with RewardPool() as pool:
        inputs = EvalInputs(
            cfg,
            tokenizer,
            examples,
            pool,
            torch.device("cpu"),
            generation_engine(cfg, model, tokenizer),
            build_environment(cfg.env),
        )
        scores, _, greedy_calls = evaluate_problems(inputs)
    assert greedy_calls == [0, 0, 1, 2, 3] and scores.tool_calls == greedy_calls
    assert scores.groups == ["easy", "easy", "easy", "hard", "hard"]
    out = summarize(scores)
    assert out["eval/tool_call_rate/easy"] == pytest.approx(1 / 3) and out["eval/tool_call_rate/hard"] == 1.0
    assert out["eval/calls_per_episode/easy"] == pytest.approx(1 / 3)
    assert out["eval/calls_per_episode/hard"] == 2.5 and out[M.EVAL_CALLS_PER_EPISODE] == 6 / 5
    assert out["eval/num_problems/easy"] == 3.0 and 0.0 <= out["eval/pass@1/hard"] <= 1.0


def test_a_held_out_example_without_the_column_is_named_when_the_data_loads(tmp_path):
    path = tmp_path / "eval.jsonl"
    path.write_text('{"question": "q1", "answer": "1", "level": "easy"}\n{"question": "q2", "answer": "2"}\n')
    data = ["data=jsonl", f"data.train_path={path}", f"data.eval_path={path}", "eval.every_steps=1"]
    load_examples(compose_config([*data, "eval.group_by=level", "eval.num_prompts=1"]))  # q1 has it
    said = "eval.group_by='level': held-out example 'eval:2' of data has no column 'level'"
    with pytest.raises(ConfigError, match=re.escape(said)):
        load_examples(compose_config([*data, "eval.group_by=level"]))
    mix = ["data.arithmetic.mix=[{name:a,share:1.0}]", "eval.group_by=difficulty", "eval.num_prompts=4"]
    load_examples(compose_config(["data.train_size=4", "data.eval_size=4", *mix]))
    with pytest.raises(
        ConfigError, match=re.escape("eval.group_by='difficulty': held-out example 'arithmetic-eval-")
    ):
        load_examples(compose_config(["data.train_size=4", "data.eval_size=4", "eval.group_by=difficulty"]))
