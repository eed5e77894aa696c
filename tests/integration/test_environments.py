"""Multi-turn environments in real runs of the tiny model: a user environment from the docs, exact resume,
env/* metrics only with an environment, and a toy tool the model learns to call."""

import json
import os
import re
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import grpo_run.trainer as trainer
from grpo_run import metrics as M
from tests.builders import LEARN, config, whole_and_resumed
from tests.helpers import FAST, REPO, read_metrics

DOCS = REPO / "docs" / "environments.md"


def without_timings(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if not k.startswith("perf/")} for row in rows]


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(run_dir / "final" / "model.safetensors")


def docs_example() -> str:
    """The one python block of docs/environments.md that defines the example environment."""
    blocks = re.findall(r"```python\n(.*?)```", DOCS.read_text(), flags=re.DOTALL)
    (example,) = [b for b in blocks if "class Lookup" in b]
    return example


@pytest.fixture
def my_envs(tmp_path, monkeypatch):
    (tmp_path / "my_envs.py").write_text(docs_example())
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    sys.modules.pop("my_envs", None)


def test_the_documented_example_environment_runs_through_its_target(my_envs, tmp_path):
    import my_envs as docs_module

    from grpo_run.data.example import Example
    from grpo_run.envs.base import Message

    env = docs_module.Lookup({"Cat": "feline"}, reward_for_answer=True)
    ex = Example("What is a cat?", "feline", "0")
    assert env.step(ex, [Message("assistant", "<lookup>cat</lookup>")]).observation == "feline"
    assert env.step(ex, [Message("assistant", "<lookup>cow</lookup>")]).tool_error
    assert env.step(ex, [Message("assistant", "A cat is feline.")]).reward == 1.0
    # A whole run with it, the kwargs from the command line.
    args = [
        *FAST,
        *QUIET_ENV,
        "env.name=lookup",
        "+env._target_=my_envs.Lookup",
        "+env.kwargs.table={cat: feline}",
    ]
    trainer.train(config(args, tmp_path / "run"))
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2] and all(M.ENV_TURNS_MEAN in r for r in rows)


QUIET_ENV = ["logger=console", "logger.console=false", "env.max_total_tokens=40"]


def test_env_metrics_are_logged_only_with_an_environment(tmp_path):
    trainer.train(config([*FAST, *QUIET_ENV[:2], "trainer.max_steps=1"], tmp_path / "single"))
    (row,) = read_metrics(tmp_path / "single")
    assert not [k for k in row if k.startswith("env/")]
    trainer.train(config([*FAST, *QUIET_ENV, "env=calculator", "trainer.max_steps=1"], tmp_path / "calc"))
    (row,) = read_metrics(tmp_path / "calc")
    assert set(M.ENV_KEYS) <= set(row)
    assert (
        row[M.ENV_TURNS_MEAN] == 1.0 and row[M.ENV_TOOL_CALLS_MEAN] == 0.0
    )  # the tiny model writes no <calc>


@pytest.mark.parametrize(
    "env",
    [
        ["env=calculator"],
        # every turn answered: episodes of several turns, observation tokens in every completion
        ["env.name=always", "+env._target_=tests.envs.toy.AlwaysAnswers", "env.max_turns=3"],
    ],
)
def test_resume_mid_run_with_an_environment_is_bitwise_identical(tmp_path, env):
    args = [*LEARN, *QUIET_ENV, *env, "aggregation=per_token"]
    whole, resumed = whole_and_resumed(args, tmp_path)
    assert [r["step"] for r in read_metrics(resumed)] == [3, 4]
    assert without_timings(read_metrics(resumed)) == without_timings(read_metrics(whole))[2:]
    a, b = final_weights(whole), final_weights(resumed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    if "env.max_turns=3" in env:
        assert all(r[M.ENV_OBSERVATION_TOKENS_MEAN] > 0 for r in read_metrics(whole))


def test_the_tiny_model_learns_to_call_a_tool_only_it_can_be_rewarded_through(tmp_path):
    """KnockTool (tests/envs/toy.py): a turn holding 'b' calls the tool; only an episode that called it
    earns reward 1. The tool-call rate and with it the reward rise over 30 steps (docs/environments.md)."""
    args = [*LEARN, *QUIET_ENV, "trainer.max_steps=30", "trainer.prompts_per_step=4", "env.max_turns=2"]
    args += ["env.name=knock", "+env._target_=tests.envs.toy.KnockTool", "+env.kwargs.knock=b"]
    trainer.train(config(args, tmp_path / "run"))
    rows = read_metrics(tmp_path / "run")
    calls = [r[M.ENV_TOOL_CALLS_MEAN] for r in rows]
    assert [r[M.REWARD_MEAN] for r in rows] == pytest.approx(calls)  # the reward is the tool-call rate
    early, late = sum(calls[:8]) / 8, sum(calls[-6:]) / 6
    assert early < 0.4 and late > early + 0.3, calls


@pytest.mark.parametrize(
    "extra",
    [
        ["lora=default"],
        ["backend=plain"],
        ["grpo.filter_zero_std=true", "aggregation=per_token", "grpo.beta=0.04", "grpo.num_iterations=2"],
    ],
)
def test_episodes_train_with_lora_the_plain_backend_and_dynamic_sampling(tmp_path, extra):
    args = [
        *FAST,
        *QUIET_ENV,
        "env.name=always",
        "+env._target_=tests.envs.toy.AlwaysAnswers",
        "env.max_turns=3",
    ]
    trainer.train(config([*args, *extra, "trainer.max_steps=1"], tmp_path / "run"))
    (row,) = read_metrics(tmp_path / "run")
    assert row[M.ENV_TURNS_MEAN] > 1 and row[M.ENV_OBSERVATION_TOKENS_MEAN] > 0
    assert M.LOSS in row or row[M.DROPPED_GROUPS] > 0


def test_the_held_out_evaluation_runs_the_environment_and_reports_the_tool_call_rate(tmp_path):
    evals = ["eval.every_steps=1", "eval.num_prompts=3", "eval.samples_per_prompt=2", "eval.max_new_tokens=4"]
    args = [*FAST, *QUIET_ENV, *evals, "trainer.max_steps=1"]
    always = ["env.name=always", "+env._target_=tests.envs.toy.AlwaysAnswers", "env.max_turns=2"]
    trainer.train(config([*args, *always], tmp_path / "always"))
    rows = read_metrics(tmp_path / "always")
    assert [r["step"] for r in rows] == [0, 1]
    assert all(r[M.EVAL_TOOL_CALL_RATE] == 1.0 for r in rows)  # every greedy episode's first turn is answered
    summary = json.loads((tmp_path / "always" / "eval_summary.json").read_text())
    assert summary["step 0"][M.EVAL_TOOL_CALL_RATE] == summary["step 1"][M.EVAL_TOOL_CALL_RATE] == 1.0
    from grpo_run.evaluation.report import results_table

    table = results_table("t", {"step 0": summary["step 0"]}, 2, 3)
    assert M.EVAL_TOOL_CALL_RATE in table.columns[0]._cells
    trainer.train(config([*args, "env=calculator"], tmp_path / "calc"))
    assert all(r[M.EVAL_TOOL_CALL_RATE] == 0.0 for r in read_metrics(tmp_path / "calc"))
    trainer.train(config(args, tmp_path / "single"))
    assert not any(M.EVAL_TOOL_CALL_RATE in r for r in read_metrics(tmp_path / "single"))


def test_zero2_two_ranks_run_the_episodes_of_a_single_process_run(tmp_path):
    """Each rank runs its share of the step's episodes; the step's env/* and reward statistics are the
    one-process run's, and so are the weights (to AdamW's rounding tolerance)."""
    from tests.builders import ZERO2, run_here, run_in
    from tests.helpers import adamw_tolerance

    args = [a for a in FAST if not a.startswith(("trainer.max_steps", "trainer.micro_batch_size"))]
    args += ["trainer.max_steps=2", "trainer.micro_batch_size=2", "trainer.lr=1e-3", *QUIET_ENV]
    args += ["env.name=always", "+env._target_=tests.envs.toy.AlwaysAnswers", "env.max_turns=3"]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in [str(REPO), os.environ.get("PYTHONPATH")] if p),
    }
    single_dir = run_here(args, tmp_path / "single" / "run")  # the baseline, in this process
    proc = run_in(tmp_path / "zero2", [*args, *ZERO2], env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (zero2_dir,) = [p for p in (tmp_path / "zero2" / "outputs" / "runs").glob("*/*") if p.is_dir()]
    zero2, single = read_metrics(zero2_dir), read_metrics(single_dir)
    for key in [*M.ENV_KEYS, M.REWARD_MEAN, M.COMPLETION_LEN_MEAN, M.LOSS]:
        assert [r[key] for r in zero2] == pytest.approx([r[key] for r in single], rel=1e-5, abs=1e-7), key
    assert all(r[M.ENV_OBSERVATION_TOKENS_MEAN] > 0 for r in zero2)
    a, b = final_weights(zero2_dir), final_weights(single_dir)
    assert max((a[k] - b[k]).abs().max().item() for k in a) < adamw_tolerance(lr=1e-3, steps=2)


@pytest.mark.parametrize(
    "env",
    [
        [],  # the preset's calculator: the tiny model writes no <calc>, so no call is ever made
        ["env.name=records", "+env._target_=tests.envs.toy.RecordsCalls"],  # every turn calls: costs apply
    ],
)
def test_calculator_when_resumes_bitwise_identical(tmp_path, env):
    """experiment=calculator_when (a cost per call, tool-free episodes, difficulty buckets evaluated every
    2 steps) on the tiny model: 4 steps in one go equal 2 + a resume, metric for metric and weight for
    weight. target_char is no gold check, so its levels are given."""
    args = ["experiment=calculator_when", *LEARN, *QUIET_ENV, *env, "env.reward_levels=[0,1]"]
    args += ["eval.every_steps=2", "eval.num_prompts=4", "trainer.prompts_per_step=2"]
    whole, resumed = whole_and_resumed(args, tmp_path)
    rows, after = read_metrics(whole), without_timings(read_metrics(resumed))
    assert (
        after == [r for r in without_timings(rows) if r["step"] > 2] and after
    )  # steps 3, 4 and step 4's eval
    a, b = final_weights(whole), final_weights(resumed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    evals = [r for r in rows if M.EVAL_S in r]
    assert [r["step"] for r in evals] == [0, 2, 4]
    assert all({"eval/pass@1/easy", "eval/pass@1/hard"} <= set(r) for r in evals)  # per bucket
    steps = [r for r in rows if M.REWARD_MEAN in r]
    assert len(steps) == 4 and all(M.TOOL_FREE_REWARD_MEAN in r for r in steps)
    if env:  # every episode called, so every one with a positive reward paid for it
        assert all(r[M.ENV_CALL_COST_MEAN] > 0 for r in steps)
