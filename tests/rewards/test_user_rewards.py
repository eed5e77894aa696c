"""A user's reward function by `_target_`: TRL's call, columns as keywords, errors counted, never fatal."""

import os

import pytest

from grpo_run.config import ConfigError
from grpo_run.config.schema import RewardConfig, RewardFunctionConfig
from grpo_run.scoring import RewardPool, UserInputs, score
from grpo_run.scoring.run_scorer import RunScorer, reward_specs
from grpo_run.scoring.user import RewardTrainerState
from tests.rewards import user_rewards as U

MODULE = "tests.rewards.user_rewards"


def entry(target: str, **fields) -> RewardFunctionConfig:
    return RewardFunctionConfig(_target_=f"{MODULE}.{target}", **fields)


def scorer(
    *entries: RewardFunctionConfig, timeout_s: float = 10.0, pool: RewardPool | None = None
) -> RunScorer:
    cfg = RewardConfig(functions=list(entries), timeout_s=timeout_s)
    return RunScorer(cfg, pool or RewardPool(preload=()), report_errors=False)


def call(run: RunScorer, completions, *, prompts=None, columns=None, step=3):
    n = len(completions)
    inputs = UserInputs(prompts=prompts or ["q"] * n, columns=columns or {}, step=step)
    return run(["q"] * n, list(completions), ["gold"] * n, [len(c) for c in completions], inputs)


def test_a_function_in_trls_documented_form_runs_unchanged():
    result = call(scorer(entry("length_reward")), ["x" * 20, "x" * 10])
    # -|20 - 20| / 20 = 0, -|20 - 10| / 20 = -0.5
    assert result.total == [0.0, -0.5]
    assert result.per_function == {"length_reward": [0.0, -0.5]}


def test_every_column_arrives_under_its_own_name_with_ids_and_step():
    U.CALLS.clear()
    columns = {"answer": ["4", "5"], "level": [1, 2], "completion_ids": [[7, 8], [9]]}
    call(scorer(entry("records_kwargs")), ["c1", "c2"], prompts=["p1", "p2"], columns=columns, step=3)
    (got,) = U.CALLS
    assert got == {
        "prompts": ["p1", "p2"],
        "completions": ["c1", "c2"],
        "answer": ["4", "5"],
        "level": [1, 2],
        "completion_ids": [[7, 8], [9]],
        "completion_lengths": [2, 2],
        "step": 3,
        "trainer_state": RewardTrainerState(global_step=3),  # TRL's; UserInputs gave only the step
    }


def test_a_column_read_by_name():
    result = call(scorer(entry("matches_answer")), ["it is 4", "it is 6"], columns={"answer": ["4", "5"]})
    assert result.total == [1.0, 0.0]


def test_chat_prompts_give_completions_as_assistant_messages():
    prompts = [[{"role": "user", "content": "say a"}]] * 2
    result = call(scorer(entry("chat_contains_a")), ["a!", "no"], prompts=prompts)
    assert result.total == [1.0, 0.0] and result.errors == 0


def test_function_kwargs_are_added_to_every_call_and_weights_apply():
    run = scorer(entry("scaled", kwargs={"scale": 2.0}, weight=0.5))
    # "aab": 2/3 of a's, x scale 2, x weight 0.5 = 2/3
    assert call(run, ["aab"]).total == [pytest.approx(2 / 3)]


def test_a_class_is_built_once_with_its_kwargs_and_called_per_batch():
    U.CountsA.built = 0
    run = scorer(entry("CountsA", kwargs={"letter": "b", "bonus": 1.0}, name="count_b"))
    assert call(run, ["bb", "ab"]).per_function == {"count_b": [2.0, 1.5]}
    assert call(run, ["b"]).total == [2.0]
    assert U.CountsA.built == 1


def test_async_functions_of_one_step_run_concurrently():
    # Each waits (5 s at most) for the other to start: awaited one after the other, both would fail.
    U.reset_events()
    result = call(scorer(entry("async_left"), entry("async_right")), ["a", "b"])
    assert result.errors == 0 and result.total == [2.0, 2.0]


def test_an_async_function_alone_and_in_the_pool():
    U.reset_events()
    run = scorer(entry("async_left"), entry("async_right"))
    assert call(run, ["a"]).total == [2.0]


def test_raising_nan_and_wrong_length_are_counted_per_function_and_never_raise():
    run = scorer(entry("raises_on_b"), entry("nan_reward"), entry("one_value"), entry("length_reward"))
    result = call(run, ["a" * 20, "b" * 20, "c" * 20])
    # raises_on_b: only "bbb.." fails (found by calling one at a time); one value for 3: all 3; NaN is
    # TRL's "not applicable" (nansum), no error.
    assert result.errors_by_function == {
        "raises_on_b": 1,
        "nan_reward": 0,
        "one_value": 3,
        "length_reward": 0,
    }
    assert result.errors == 4
    assert result.per_function["nan_reward"] == [None, None, None]
    assert result.per_function["raises_on_b"] == [1.0, 0.0, 1.0]
    assert result.total == [1.0, 0.0, 1.0]  # length_reward is 0 at 20 characters


def test_none_is_unscorable():
    result = call(scorer(entry("none_for_empty")), ["", "x"])
    assert result.total == [None, 1.0] and result.unscorable == 1


def test_isolated_runs_in_the_pool_and_a_hang_is_a_timeout():
    with RewardPool(preload=()) as pool:
        run = scorer(entry("worker_pid", isolated=True), timeout_s=20, pool=pool)
        (pid,) = call(run, ["x"]).total
        assert pid != os.getpid()
        hanging = scorer(entry("hangs_on_hang", isolated=True), timeout_s=3, pool=pool)
        result = call(hanging, ["fine", "hang"])
    assert result.total == [1.0, 0.0] and result.timeouts == 1 and result.errors == 0
    assert result.timeouts_by_function == {"hangs_on_hang": 1}


def test_an_isolated_class_gets_its_kwargs_in_the_worker():
    with RewardPool(preload=()) as pool:
        run = scorer(entry("CountsA", kwargs={"letter": "z"}, isolated=True), pool=pool)
        assert call(run, ["zz", "az"]).total == [1.0, 0.5]


def test_range_gives_the_bounds_and_no_range_gives_none():
    assert scorer(entry("length_reward")).bounds is None
    ranged = scorer(entry("length_reward", range=[-1.0, 0.0], weight=2.0), RewardFunctionConfig("format"))
    assert ranged.bounds == (-2.0, 1.0)  # 2 x [-1, 0] + [0, 1]


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("tests.rewards.no_such_module.fn", "cannot be imported"),
        (f"{MODULE}.no_such_fn", "cannot be imported"),
        (f"{MODULE}.NOT_CALLABLE", "is not a function or a class"),
        (f"{MODULE}.no_kwargs", r"must take \(prompts, completions, \*\*kwargs\)"),
    ],
)
def test_a_bad_target_is_a_config_error_naming_the_key(target, message):
    cfg = RewardConfig(functions=[RewardFunctionConfig("format"), RewardFunctionConfig(_target_=target)])
    with pytest.raises(ConfigError, match=rf"reward\.functions\[1\]\._target_=.*{message}"):
        reward_specs(cfg)


def test_a_class_that_does_not_take_its_kwargs_is_a_config_error():
    cfg = RewardConfig(functions=[entry("CountsA", kwargs={"colour": "red"})])
    with pytest.raises(ConfigError, match=r"reward\.functions\[0\]\._target_.*does not take its kwargs"):
        reward_specs(cfg)


def test_two_entries_of_one_name_are_refused():
    cfg = RewardConfig(functions=[entry("length_reward"), entry("length_reward", weight=2.0)])
    with pytest.raises(ConfigError, match="appear twice"):
        reward_specs(cfg)


def test_built_ins_and_user_functions_share_one_scorer():
    run = scorer(RewardFunctionConfig("format"), entry("matches_answer"))
    result = call(run, [r"\boxed{4}", "5"], columns={"answer": ["4", "4"]})
    assert result.per_function == {"format": [1.0, 0.0], "matches_answer": [1.0, 0.0]}


def test_score_without_user_inputs_passes_the_plain_prompts():
    result = score(
        [reward_specs(RewardConfig(functions=[entry("length_reward")]))[0]],
        ["q"],
        ["x" * 20],
        ["g"],
        timeout_s=5,
    )
    assert result.total == [0.0]


def test_numpy_and_torch_results_in_process_and_in_the_pool():
    with RewardPool(preload=()) as pool:
        for isolated in (False, True):
            run = scorer(
                RewardFunctionConfig(_target_="tests.rewards.trl_rewards.numpy_length", isolated=isolated),
                RewardFunctionConfig(_target_="tests.rewards.trl_rewards.torch_has_digit", isolated=isolated),
                pool=pool,
            )
            result = call(run, ["abcdefgh", "1"])
            # numpy_length: (8 // 4) / 4 = 0.5 and (1 // 4) / 4 = 0; torch_has_digit: 0 and 1
            assert result.per_function == {"numpy_length": [0.5, 0.0], "torch_has_digit": [0.0, 1.0]}
            assert result.errors == 0 and result.total == [0.5, 1.0]


def test_a_factory_target_is_called_once_with_its_kwargs():
    run = scorer(entry("make_scaled", kwargs={"scale": 2.0}, name="scaled_len"))
    assert call(run, ["abc", "a"]).total == [6.0, 2.0]  # 2 x 3 and 2 x 1
    with pytest.raises(ConfigError, match="cannot be called|must take"):
        reward_specs(RewardConfig(functions=[entry("make_scaled", kwargs={"factor": 2.0})]))


def test_trainer_state_counts_updates_done_and_epochs_as_transformers_does():
    # 10 steps of 4 prompts over 6 examples: ceil(40 / 6) = 7 epochs; step 4 is scored after 3 updates,
    # 12 prompts drawn = 2.0 epochs.
    run = RunScorer(RewardConfig(), RewardPool(preload=()), max_steps=10, prompts_per_step=4, train_size=6)
    assert run.trainer_state(4) == RewardTrainerState(
        global_step=3, max_steps=10, epoch=2.0, num_train_epochs=7
    )
    assert run.trainer_state(1).global_step == 0


def test_unfilled_parameters_name_what_no_column_or_call_argument_gives():
    from grpo_run.scoring.run_scorer import check_columns

    fine = RewardConfig(functions=[entry("level_reward"), entry("scaled", kwargs={"scale": 1.0})])
    check_columns(fine, {"level"})
    with pytest.raises(ConfigError, match=r"parameter 'level' is neither a column.*columns: answer"):
        check_columns(RewardConfig(functions=[entry("level_reward")]), {"answer"})
