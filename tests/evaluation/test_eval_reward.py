"""eval.reward (grpo_run/evaluation/rewards.py, grpo_run/config/checks/evaluation.py): which entries score a
held-out set, its config checks, the eval/reward_* keys from per-problem rewards, and the progress lines."""

import math

import pytest
import torch
from hydra import compose, initialize_config_dir

from grpo_run import metrics as M
from grpo_run.algo.intervals import bootstrap_mean_interval
from grpo_run.backend import generation_engine
from grpo_run.cli import CONF_DIR
from grpo_run.config import ConfigError, register_configs, to_config
from grpo_run.config.schema import RewardFunctionConfig
from grpo_run.data import Example
from grpo_run.evaluation.held_out import EvalInputs, evaluate, evaluate_problems
from grpo_run.evaluation.report import results_table
from grpo_run.evaluation.rewards import eval_reward_entries, eval_reward_specs, has_gold
from grpo_run.evaluation.stats import ProblemScores, paired_change, summarize
from grpo_run.models.loading import load_model, load_tokenizer
from grpo_run.scoring import RewardPool

register_configs()

U = "tests.rewards.user_rewards"
USER = f"reward.functions=[{{_target_: {U}.length_reward}}]"
NO_GOLD = ["data=jsonl", "data.train_path=x.jsonl", "data.eval_path=y.jsonl", "data.answer_field=null"]


def config(overrides: list[str]):
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return to_config(compose(config_name="config", overrides=overrides))


def names(cfg) -> list[str]:
    return [fn.name for fn in eval_reward_entries(cfg)]


@pytest.mark.parametrize(
    "overrides,expected",
    [
        # built-in gold checking on data with gold answers: pass@1 alone
        ([], []),
        (["reward=math_and_format"], []),
        (["reward=code_exec", "data=humaneval"], []),
        (["reward=reasoning_gym", "data=reasoning_gym"], []),
        (["data=jsonl", "data.train_path=x.jsonl", "data.eval_path=y.jsonl"], []),
        # a user's function, a built-in that checks no gold, or a gold checker beside a user function
        ([USER], ["length_reward"]),
        (["reward=target_char"], ["target_char_fraction"]),
        (
            [f"reward.functions=[{{name: math_verifier}}, {{_target_: {U}.scaled, name: mine}}]"],
            ["math_verifier", "mine"],
        ),
        # no gold column: the training entries, whatever they are
        ([*NO_GOLD, "reward=format"], ["format"]),
        ([*NO_GOLD, USER], ["length_reward"]),
        # explicit: train, a list of its own, none; null is auto
        (["eval.reward=train"], ["math_verifier"]),
        ([USER, "eval.reward=train"], ["length_reward"]),
        ([USER, "eval.reward=[]"], []),
        ([USER, "eval.reward=null"], ["length_reward"]),
        (
            [f"eval.reward=[{{_target_: {U}.scaled, weight: 2, kwargs: {{scale: 3}}}}, {{name: format}}]"],
            ["scaled", "format"],
        ),
    ],
)
def test_which_entries_score_the_held_out_set(overrides, expected):
    cfg = config(["model=tiny", *overrides])
    assert names(cfg) == expected


def test_a_list_keeps_its_weights_and_kwargs_and_train_the_training_weights():
    cfg = config(["model=tiny", f"eval.reward=[{{_target_: {U}.scaled, weight: 2, kwargs: {{scale: 3}}}}]"])
    [fn] = eval_reward_entries(cfg)
    assert isinstance(fn, RewardFunctionConfig) and fn.weight == 2 and fn.kwargs == {"scale": 3}
    [spec] = eval_reward_specs(cfg)
    assert spec.name == "scaled" and spec.weight == 2
    cfg = config(["model=tiny", "reward=math_and_format", "eval.reward=train"])
    assert [(s.name, s.weight) for s in eval_reward_specs(cfg)] == [
        (fn.name, fn.weight) for fn in cfg.reward.functions
    ]


def test_an_eval_datasets_set_without_gold_gets_the_training_entries():
    """auto is decided per held-out set: the run's own split has gold (pass@1 alone), the extra set none."""
    from dataclasses import replace

    cfg = config(
        [
            "model=tiny",
            "reward=format",
            "+data@eval.datasets.chats=jsonl",
            "eval.datasets.chats.eval_path=z.jsonl",
            "eval.datasets.chats.answer_field=null",
        ]
    )
    assert names(cfg) == ["format"]  # format checks no gold: the training entries on both sets
    cfg = config(["model=tiny", "+data@eval.datasets.chats=jsonl", "eval.datasets.chats.eval_path=z.jsonl"])
    chats = replace(cfg, data=replace(cfg.eval.datasets["chats"], answer_field=None))
    assert names(cfg) == [] and names(chats) == ["math_verifier"]
    assert has_gold(cfg.data) and not has_gold(chats.data)


@pytest.mark.parametrize(
    "override,key",
    [
        ("eval.reward=everything", "eval.reward='everything'"),
        ("eval.reward=3", "eval.reward=3"),
        ("eval.reward=[{name: nope}]", "eval.reward[0].name='nope'"),
        ("eval.reward=[{name: format, colour: red}]", "eval.reward[0].colour='red'"),
        ("eval.reward=[{name: format, weight: nan}]", "eval.reward[0].weight=nan"),
        (f"eval.reward=[{{_target_: {U}.scaled, range: [1, 0]}}]", "eval.reward[0].range=[1.0, 0.0]"),
        ("eval.reward=[{name: format}, 7]", "eval.reward[1]=7"),
    ],
)
def test_a_bad_eval_reward_names_its_key_and_value(override, key):
    with pytest.raises(ConfigError) as err:
        config(["model=tiny", override])
    assert str(err.value).startswith(key), str(err.value)


def test_a_target_that_does_not_import_or_a_name_twice_fails_when_the_specs_are_built():
    cfg = config(["model=tiny", "eval.reward=[{_target_: tests.no_such_module.fn}]"])
    with pytest.raises(ConfigError, match=r"eval.reward\[0\]._target_"):
        eval_reward_specs(cfg)
    cfg = config(["model=tiny", "eval.reward=[{name: format}, {name: format, weight: 2}]"])
    with pytest.raises(ConfigError, match="appear twice"):
        eval_reward_specs(cfg)


def test_a_held_out_set_may_not_be_named_rewards():
    with pytest.raises(ConfigError, match="eval.datasets='rewards'"):
        config(["model=tiny", "+data@eval.datasets.rewards=arithmetic", "eval.datasets.rewards.eval_size=4"])


def rewarded(reward, rewards, *, graded=True, errors=0, ids=None) -> ProblemScores:
    n = len(reward)
    ids = ids or [f"p{i}" for i in range(n)]
    greedy = [1.0] * n if graded else [None] * n
    flat = [1.0] * (2 * n) if graded else []
    s = ProblemScores.from_rows(ids, greedy, flat, [0.0] * n, [4] * n, k=2, graded=graded)
    s.reward, s.rewards, s.reward_errors = reward, rewards, errors
    return s


def test_reward_keys_worked_numbers():
    # 4 problems; p2's completion is unscorable (a function said None): out of the means, counted.
    s = rewarded(
        [0.5, -1.0, None, 2.5],
        {"a": [0.5, 0.0, None, 0.5], "b": [0.0, -0.5, 1.0, 1.0]},
        graded=False,
        errors=1,
    )
    out = summarize(s)
    # mean of the scorable totals: (0.5 - 1 + 2.5) / 3 = 2/3; a percentile bootstrap over those problems
    assert out[M.EVAL_REWARD_MEAN] == pytest.approx(2 / 3)
    expected = bootstrap_mean_interval(torch.tensor([0.5, -1.0, 2.5]), num_resamples=2000, seed=0).tolist()
    assert [out[M.EVAL_REWARD_MEAN_CI_LOW], out[M.EVAL_REWARD_MEAN_CI_HIGH]] == pytest.approx(expected)
    # per function, each over the values it gave: a (0.5 + 0 + 0.5) / 3, b (0 - 0.5 + 1 + 1) / 4
    assert out["eval/rewards/a_mean"] == pytest.approx(1 / 3) and out["eval/rewards/b_mean"] == 0.375
    assert out["eval/rewards/a_mean_ci_low"] <= 1 / 3 <= out["eval/rewards/a_mean_ci_high"]
    assert out[M.EVAL_REWARD_UNSCORABLE] == 1 and out[M.EVAL_REWARD_ERRORS] == 1
    # no gold answers: no correctness key at all (no meaningless 0)
    for key in (M.EVAL_ACCURACY, M.EVAL_MEAN_AT_K, M.EVAL_PASS_AT_K, M.EVAL_NUM_PROBLEMS):
        assert key not in out
    assert out[M.EVAL_COMPLETION_LEN] == 4
    # a named set's keys
    assert "eval/extra/reward_mean" in summarize(s, "extra") and "eval/extra/rewards/a_mean" in summarize(
        s, "extra"
    )


def test_without_eval_reward_no_reward_keys_and_with_gold_both():
    plain = rewarded([1.0], {}, graded=True)
    plain.reward = None
    assert not any("reward" in k for k in summarize(plain))
    both = summarize(rewarded([1.0, 0.0], {"a": [1.0, 0.0]}))
    assert both[M.EVAL_ACCURACY] == 1.0 and both[M.EVAL_REWARD_MEAN] == 0.5


def test_paired_change_of_the_reward_over_problems_both_scored():
    before = rewarded([0.0, 1.0, None, 0.5], {}, graded=False)
    after = rewarded([1.0, 1.0, 2.0, 0.5], {}, graded=False)
    out = paired_change(before, after)
    # differences over p0, p1, p3 (p2 unscorable before): [1, 0, 0]
    expected = bootstrap_mean_interval(torch.tensor([1.0, 0.0, 0.0]), num_resamples=2000, seed=0).tolist()
    assert [out[M.EVAL_REWARD_MEAN_CI_LOW], out[M.EVAL_REWARD_MEAN_CI_HIGH]] == pytest.approx(expected)
    assert M.EVAL_ACCURACY_CI_LOW not in out and M.EVAL_NUM_PROBLEMS not in out  # no gold: no correctness


def test_the_table_shows_the_reward_and_no_correctness_rows_without_gold():
    values = summarize(rewarded([0.5, 1.5], {"a": [0.5, 1.5]}, graded=False))
    table = results_table("held-out", {"value": values}, k=4, n=2)
    rows = list(table.columns[0].cells)
    assert rows[:2] == [M.EVAL_BOXED_FRACTION, M.EVAL_COMPLETION_LEN]
    assert M.EVAL_REWARD_MEAN in rows and "eval/rewards/a_mean" in rows and M.EVAL_ACCURACY not in rows
    assert "greedy only" in str(table.title)
    assert list(table.columns[1].cells)[rows.index(M.EVAL_REWARD_MEAN)].startswith("1.000 [")


@pytest.fixture(scope="module")
def tiny():
    cfg = config(["model=tiny", "trainer.device=cpu"])
    tokenizer = load_tokenizer(cfg.model)
    model = load_model(cfg.model, torch.device("cpu"), trainable=False)
    return tokenizer, generation_engine(cfg, model, tokenizer)


def held_out(n: int) -> list[Example]:
    return [
        Example(f"Say {i}", "", f"q{i}", columns={"question": f"Say {i}", "level": i % 2}) for i in range(n)
    ]


def test_a_user_reward_on_data_without_gold_on_the_tiny_model(tiny, capsys):
    """The greedy completions scored by the user's functions, with the dataset's own column (`level`); a
    function that raises or says None never ends the evaluation; progress lines on the console."""
    tokenizer, engine = tiny
    rewards = (
        f"reward.functions=[{{_target_: {U}.level_reward}}, {{_target_: {U}.raises_on_b, weight: 0.5}},"
        f" {{_target_: {U}.none_for_empty, weight: 0}}]"
    )
    cfg = config(
        [
            "model=tiny",
            *NO_GOLD,
            rewards,
            "eval.num_prompts=5",
            "eval.batch_size=2",
            "generation.max_new_tokens=6",
        ]
    )
    with RewardPool() as pool:
        inputs = EvalInputs(
            cfg, tokenizer, held_out(6), pool, torch.device("cpu"), engine, step=3, progress=True
        )
        scores, _, _ = evaluate_problems(inputs)
        values = evaluate(inputs)
    assert not scores.graded and scores.sampled == [[]] * 5  # no sampled pass without gold answers
    assert scores.rewards["level_reward"] == [0.0, 1.0, 0.0, 1.0, 0.0]  # read from the `level` column
    assert M.EVAL_ACCURACY not in values and M.EVAL_REWARD_MEAN in values
    unscorable = scores.reward.count(None)
    assert values[M.EVAL_REWARD_UNSCORABLE] == unscorable
    known = [r for r in scores.reward if r is not None]
    assert values[M.EVAL_REWARD_MEAN] == (pytest.approx(sum(known) / len(known)) if known else math.nan)
    out = capsys.readouterr().err
    assert "held-out evaluation at step 3: default, 5 problems, completions: greedy only" in out
    assert "eval default greedy: 2/5 problems" in out and "eval default greedy: 5/5 problems" in out
    assert "eta" in out


def test_with_gold_both_passes_show_progress_and_the_user_reward_is_scored_beside_pass_at_1(tiny, capsys):
    tokenizer, engine = tiny
    cfg = config(["model=tiny", USER, "eval.num_prompts=4", "eval.batch_size=4", "eval.samples_per_prompt=2"])
    examples = [Example(f"What is {i} + 1?", str(i + 1), f"q{i}") for i in range(4)]
    with RewardPool() as pool:
        values = evaluate(
            EvalInputs(cfg, tokenizer, examples, pool, torch.device("cpu"), engine, progress=True)
        )
    assert M.EVAL_ACCURACY in values and M.EVAL_PASS_AT_K in values and M.EVAL_REWARD_MEAN in values
    assert values["eval/rewards/length_reward_mean"] == values[M.EVAL_REWARD_MEAN]  # one entry, weight 1
    out = capsys.readouterr().err
    assert "held-out evaluation: default, 4 problems, completions: greedy + 2 sampled" in out
    assert "eval default sampled (k=2): 4/4 problems" in out
    # not the main rank: nothing printed
    with RewardPool() as pool:
        evaluate(EvalInputs(cfg, tokenizer, examples, pool, torch.device("cpu"), engine))
    assert "held-out evaluation" not in capsys.readouterr().err
