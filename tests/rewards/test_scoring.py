"""The safe caller: weighted sums, errors, unscorable golds, wrong lengths, and the process pool's budget.

The functions defined at the top of this module run in pool workers too: spawn hands the workers this
process's sys.path, so they import this module by the same name.
"""

import multiprocessing
import os
import signal
import threading
import time

import pytest

from grpo_run.rewards import RewardName
from grpo_run.scoring import RewardPool, RewardSpec, score
from grpo_run.scoring.pool import RewardPoolError


def always_one(prompts, completions, answers, **kwargs):
    return [1.0] * len(completions)


def length_reward(prompts, completions, answers, **kwargs):
    return [float(len(completion)) for completion in completions]


def boom_on_x(prompts, completions, answers, **kwargs):
    for completion in completions:
        if completion == "x":
            raise ZeroDivisionError("cannot score x")
    return [1.0] * len(completions)


def too_short(prompts, completions, answers, **kwargs):
    return [1.0] * (len(completions) - 1)


def sleepy(prompts, completions, answers, **kwargs):
    if "hang" in completions[0]:
        time.sleep(30)
    return [1.0] * len(completions)


def test_weighted_sum_of_two_functions():
    specs = [RewardSpec("always_one", weight=0.5), RewardSpec("length_reward", weight=2.0)]
    functions = {"always_one": always_one, "length_reward": length_reward}
    result = score(specs, ["p"] * 3, ["", "ab", "abcd"], ["a"] * 3, timeout_s=5, functions=functions)
    # 0.5·1 + 2·0 = 0.5; 0.5·1 + 2·2 = 4.5; 0.5·1 + 2·4 = 8.5
    assert result.total == [0.5, 4.5, 8.5]
    assert result.per_function == {"always_one": [1.0, 1.0, 1.0], "length_reward": [0.0, 2.0, 4.0]}
    assert (result.errors, result.timeouts, result.unscorable, result.first_error) == (0, 0, 0, None)


def test_registered_functions_in_process_with_batch_kwargs():
    specs = [
        RewardSpec(RewardName.FORMAT, weight=1.0),
        RewardSpec("overlong_penalty", weight=1.0, kwargs={"max_new_tokens": 100, "buffer_length": 20}),
    ]
    result = score(
        specs,
        ["p"] * 3,
        [r"\boxed{1}", "1", r"\boxed{2}"],
        ["1"] * 3,
        timeout_s=5,
        batch_kwargs={"completion_lengths": [50, 90, 100]},
    )
    # format 1, 0, 1 plus overlong 0, -0.5, -1
    assert result.total == pytest.approx([1.0, -0.5, 0.0])
    assert list(result.per_function) == ["format", "overlong_penalty"]


def test_a_raising_function_gives_zero_and_is_counted():
    specs = [RewardSpec("always_one"), RewardSpec("boom_on_x")]
    functions = {"always_one": always_one, "boom_on_x": boom_on_x}
    result = score(specs, ["p"] * 4, ["a", "x", "b", "x"], ["a"] * 4, timeout_s=5, functions=functions)
    # the batch call raises, so each completion is tried alone: only the two "x" fail
    assert result.per_function["boom_on_x"] == [1.0, 0.0, 1.0, 0.0]
    assert result.total == [2.0, 1.0, 2.0, 1.0]
    assert result.errors == 2
    assert result.timeouts == 0
    assert "'boom_on_x' failed on completion 1" in result.first_error
    assert "ZeroDivisionError: cannot score x" in result.first_error
    assert "Traceback" in result.first_error


def test_a_non_number_counts_as_an_error_and_nan_is_not_applicable():
    def odd_reward(prompts, completions, answers, **kwargs):
        return [float("nan"), "high", 1, float("inf")]

    result = score(
        [RewardSpec("odd")], ["p"] * 4, ["a"] * 4, ["a"] * 4, timeout_s=5, functions={"odd": odd_reward}
    )
    # NaN is TRL's "not applicable" (its nansum): no value, not an error; "high" and inf are errors (0).
    assert result.total == [None, 0.0, 1.0, 0.0]
    assert result.errors == 2 and result.unscorable == 1
    assert "not a number" in result.first_error


def test_wrong_length_is_counted_per_completion_naming_the_function():
    # 2 values for 3 completions: the function's fault, so each of the 3 is an error scoring 0.
    result = score(
        [RewardSpec("too_short"), RewardSpec("format")],
        ["p"] * 3,
        ["a"] * 3,
        ["a"] * 3,
        timeout_s=5,
        functions={"too_short": too_short},
    )
    assert result.total == [0.0, 0.0, 0.0] and result.errors == 3
    assert result.errors_by_function == {"too_short": 3, "format": 0}
    assert "'too_short' returned 2 values for 3 completions" in result.first_error


def test_unknown_name_and_mismatched_inputs_are_rejected():
    with pytest.raises(ValueError, match="unknown reward function 'nope'"):
        score([RewardSpec("nope")], ["p"], ["a"], ["a"], timeout_s=5)
    with pytest.raises(ValueError, match="2 prompts, 1 completions"):
        score([RewardSpec("format")], ["p", "q"], ["a"], ["a"], timeout_s=5)
    with pytest.raises(ValueError, match="completion_lengths"):
        score(
            [RewardSpec("format")], ["p"], ["a"], ["a"], timeout_s=5, batch_kwargs={"completion_lengths": []}
        )


def test_unscorable_gold_gives_none_total_in_process():
    specs = [RewardSpec("math_verifier"), RewardSpec("format", weight=0.1)]
    # in-process here (isolated=()), which is fine on the main thread
    result = score(
        specs,
        ["p"] * 3,
        [r"\boxed{2}", r"\boxed{2}", r"\boxed{3}"],
        ["2", r"\frac{", "2"],
        timeout_s=5,
        isolated=(),
    )
    assert result.per_function["math_verifier"] == [1.0, None, 0.0]
    # None is "not applicable" (TRL's nansum): the unparseable gold's completion keeps its format value.
    assert result.total == pytest.approx([1.1, 0.1, 0.1])
    assert result.unscorable == 0 and result.unrewarded == 0
    assert result.errors == 0

    alone = score(specs[:1], ["p"] * 3, [r"\boxed{2}"] * 3, ["2", r"\frac{", "2"], timeout_s=5, isolated=())
    assert alone.total == [1.0, None, 1.0]  # no function gave it a value: unscorable
    assert (alone.unscorable, alone.unrewarded) == (1, 1)


@pytest.fixture(scope="module")
def pool():
    with RewardPool() as reward_pool:
        yield reward_pool


def test_math_verifier_runs_in_the_pool(pool):
    completions = [r"\boxed{\frac{1}{2}}", "so 1,234", "What is 43 + 5? 43 + 5", r"\boxed{9}"]
    answers = ["0.5", "#### 1,234", "48", r"\frac{"]
    result = score([RewardSpec("math_verifier")], ["p"] * 4, completions, answers, timeout_s=10, pool=pool)
    assert result.total == [1.0, 1.0, 0.0, None]
    assert (result.errors, result.timeouts, result.unscorable) == (0, 0, 1)


def test_a_hanging_verification_is_abandoned_at_its_budget(pool):
    functions = {"sleepy": sleepy}
    warm = score(
        [RewardSpec("sleepy")],
        ["p"],
        ["ok"],
        ["a"],
        timeout_s=10,
        pool=pool,
        functions=functions,
        isolated={"sleepy"},
    )
    assert warm.total == [1.0]  # workers started and this module imported, off the clock

    start = time.monotonic()
    result = score(
        [RewardSpec("sleepy"), RewardSpec("always_one", weight=0.5)],
        ["p"] * 3,
        ["ok", "hang", "ok"],
        ["a"] * 3,
        timeout_s=1.0,
        pool=pool,
        functions={**functions, "always_one": always_one},
        isolated={"sleepy"},
    )
    elapsed = time.monotonic() - start
    # The hang costs its 1 s budget; the worker is killed and the pool restarted for the last completion.
    # A restart is off the budget but not free (a fresh process imports its modules: 9 s once on this
    # machine under load), so the bound only proves the 30 s sleep was abandoned, not waited out.
    assert elapsed < 20.0
    assert result.per_function["sleepy"] == [1.0, 0.0, 1.0]
    assert result.total == [1.5, 0.5, 1.5]
    assert result.timeouts == 1
    assert result.errors == 0
    assert result.first_error is None


def test_the_budget_is_kept_when_the_hang_is_last(pool):
    functions = {"sleepy": sleepy}
    score(
        [RewardSpec("sleepy")],
        ["p"],
        ["ok"],
        ["a"],
        timeout_s=10,
        pool=pool,
        functions=functions,
        isolated={"sleepy"},
    )
    start = time.monotonic()
    result = score(
        [RewardSpec("sleepy")],
        ["p"],
        ["hang"],
        ["a"],
        timeout_s=1.0,
        pool=pool,
        functions=functions,
        isolated={"sleepy"},
    )
    elapsed = time.monotonic() - start
    # returns within about the budget (the 30 s sleep abandoned); the margin is for a loaded machine
    assert elapsed < 1.0 + 6.0
    assert result.total == [0.0]
    assert result.timeouts == 1


def test_pool_errors_carry_the_worker_traceback(pool):
    result = score(
        [RewardSpec("boom_on_x")],
        ["p"] * 2,
        ["a", "x"],
        ["a"] * 2,
        timeout_s=10,
        pool=pool,
        functions={"boom_on_x": boom_on_x},
        isolated={"boom_on_x"},
    )
    assert result.total == [1.0, 0.0]
    assert result.errors == 1
    assert "ZeroDivisionError: cannot score x" in result.first_error


def test_pool_rejects_fork():
    with pytest.raises(ValueError, match="spawn"):
        RewardPool(start_method="fork")


def dies_once(prompts, completions, answers, marker, **kwargs):
    """Kills its own worker process the first time it is called (as a signal or the OOM killer would)."""
    if not os.path.exists(marker):
        open(marker, "w").close()
        os.kill(os.getpid(), signal.SIGKILL)
    return [1.0] * len(completions)


def always_dies(prompts, completions, answers, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_dead_worker_is_replaced_and_its_completions_scored_again(tmp_path):
    marker = str(tmp_path / "died")
    with RewardPool() as pool:
        result = score(
            [RewardSpec("dies_once", kwargs={"marker": marker})],
            ["p"] * 2,
            ["a", "b"],
            ["a"] * 2,
            timeout_s=30,
            pool=pool,
            functions={"dies_once": dies_once},
            isolated={"dies_once"},
        )
        assert pool.restarts == 1
    assert os.path.exists(marker)
    assert result.restarts == 1  # counted in this call's result (train/reward_worker_restarts)
    assert result.total == [1.0, 1.0]  # never an error scored 0
    assert result.errors == 0


def test_workers_that_keep_dying_stop_scoring_instead_of_scoring_errors():
    with RewardPool(max_restarts=1) as pool, pytest.raises(RewardPoolError, match="died 2 times in a row"):
        score(
            [RewardSpec("always_dies")],
            ["p"],
            ["a"],
            ["a"],
            timeout_s=30,
            pool=pool,
            functions={"always_dies": always_dies},
            isolated={"always_dies"},
        )


def test_a_stop_signal_while_a_worker_starts_never_reaches_it():
    """SIGTERM and SIGINT sent to a worker the moment it exists (as Slurm or Ctrl-C send them to the
    whole process group), before its initializer ran: it starts with them blocked, ignores them before
    unblocking, and scores. Before, the first SIGTERM killed it and its completions scored errors."""
    with RewardPool(preload=("grpo_run.rewards.functions",)) as pool:
        before = {p.pid for p in multiprocessing.active_children()}
        starting = threading.Thread(target=pool._ready_for, args=(always_one.__module__,))
        starting.start()
        deadline = time.monotonic() + 30
        while not (new := [p for p in multiprocessing.active_children() if p.pid not in before]):
            assert time.monotonic() < deadline
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
            os.kill(new[0].pid, signum)
        starting.join(timeout=120)
        assert new[0].is_alive()
        assert pool.run(always_one, [((["p"], ["a"], ["a"]), {})], timeout_s=30)[0].value == [1.0]
        assert pool.restarts == 0
