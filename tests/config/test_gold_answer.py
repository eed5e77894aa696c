"""A reward that scores against the gold answer, on records that have none (a file or hub source with
data.answer_field=null and no `answer` column), is a config error when the data loads, naming both keys;
rewards that need no gold, data that has an answer column, and the generated sources are not."""

import re

import pytest

from grpo_run.config import ConfigError
from grpo_run.config.checks.reward import validate_gold_answers
from tests.builders import compose_config

FILE = ["data=jsonl", "data.train_path=train.jsonl", "eval.every_steps=0"]  # nothing is read at the door
NO_GOLD = [*FILE, "data.answer_field=null"]


@pytest.mark.parametrize(
    "overrides,name",
    [
        ([*NO_GOLD, "reward=math_verifier"], "math_verifier"),
        ([*NO_GOLD, "reward=math_and_format"], "math_verifier"),  # functions[0]; format needs no gold
        (
            ["data=humaneval", "data.answer_field=null", "data.entry_point_field=null", "reward=code_exec"],
            "code_exec",
        ),
    ],
)
def test_a_gold_answer_reward_without_gold_answers_names_both_keys(overrides, name):
    said = f"reward.functions[0].name='{name}': cannot be combined with data.answer_field=None"
    with pytest.raises(ConfigError, match=re.escape(said)):
        validate_gold_answers(compose_config(overrides), answered=False)
    validate_gold_answers(compose_config(overrides), answered=True)  # null read an `answer` column


@pytest.mark.parametrize(
    "overrides",
    [
        [*NO_GOLD, "reward=format"],  # reads the completion only
        [*NO_GOLD, "reward.functions=[{_target_: my_rewards.fn}]"],  # a user's reads its own columns
        [*FILE, "reward=math_verifier"],  # data.answer_field=answer, the default
        ["data=arithmetic", "data.answer_field=null", "reward=math_verifier"],  # generated: always answered
    ],
)
def test_rewards_and_sources_that_need_no_gold_column_pass(overrides):
    validate_gold_answers(compose_config(overrides), answered=False)
