"""The pure parts of the code_exec reward (grpo_run/rewards/code.py), its labels in the scorer, its config.

Nothing here runs untrusted code: the programs built are either only compared as text, or (split_asserts)
made from the test's own trusted source and run in-process to read the cases it records.
"""

import gzip
import json
import time

import pytest

from grpo_run import metrics as M
from grpo_run.config import ConfigError
from grpo_run.data import load_split
from grpo_run.data.splits import load_data, load_eval_split
from grpo_run.rewards.code import (
    CASES_NAME,
    CodeOutcome,
    bare_body,
    build_program,
    build_tests,
    candidate_names,
    code_reward,
    extract_code,
    is_body,
    split_asserts,
)
from grpo_run.rewards.functions import LabelledRewards
from grpo_run.scoring import RewardPool, RewardSpec, score
from grpo_run.scoring.registry import BUILTIN_REWARDS
from tests.builders import compose_config

PROMPT = 'def add(a, b):\n    """Sum of a and b."""\n'
TEST = "def check(candidate):\n    assert candidate(1, 2) == 3\n    assert candidate(0, 0) == 0\n\ncheck(add)"


# --- extraction ---------------------------------------------------------------------------------------


def test_extract_code_takes_the_first_python_fence():
    text = "Here it is:\n```python\ndef add(a, b):\n    return a + b\n```\nand more ```python\nx\n```"
    assert extract_code(text) == "def add(a, b):\n    return a + b\n"


def test_extract_code_untagged_fence_counts_other_languages_do_not():
    assert extract_code("```\n    return a + b\n```") == "    return a + b\n"
    text = "```bash\nrm -rf /\n```\n```py\nx = 1\n```"
    assert extract_code(text) == "x = 1\n"  # the bash block is skipped


def test_extract_code_unclosed_fence_runs_to_the_end():
    # The completion was cut at max_new_tokens inside the block.
    assert extract_code("```python\ndef f():\n    return 1") == "def f():\n    return 1"


def test_extract_code_bare_body_is_kept():
    assert extract_code("    return a + b\n") == "    return a + b\n"


def test_is_body_and_bare_body():
    assert is_body("\n    return 1\n")
    assert not is_body("def f():\n    return 1\n")
    assert is_body("")  # nothing: a body that does nothing
    # A base model goes on past the function: the top-level call is cut, a top-level comment is not a stop.
    assert bare_body("    return a + b\n\nprint(add(1, 2))\n") == "    return a + b\n\n"
    assert bare_body("    x = 1\n# note\n    return x\n") == "    x = 1\n# note\n    return x\n"


# --- the program -----------------------------------------------------------------------------------------


def test_build_program_body_continues_the_prompt():
    program = build_program(PROMPT, "    return a + b\n")
    assert program == PROMPT + "    return a + b\n" + "\n"  # no test in it: the tests run apart


def test_build_program_whole_function_follows_the_prompt():
    # The prompt's signature with only a docstring is valid Python; the completion's def replaces it.
    completion = "Sure.\n```python\ndef add(a, b):\n    return a + b\n```"
    program = build_program(PROMPT, completion)
    assert program == PROMPT + "\ndef add(a, b):\n    return a + b\n" + "\n"
    namespace: dict = {}
    exec(compile(program + TEST, "p", "exec"), namespace)  # trusted: written above; check() passes or raises


def test_build_program_adds_a_newline_to_a_prompt_without_one():
    assert build_program("x = 1", "y = 2\n").startswith("x = 1\n\ny = 2\n")


def test_build_tests_keeps_the_test_out_of_the_program_and_names_the_candidate():
    plan = build_tests(PROMPT, TEST)
    assert (plan.prompt, plan.test, plan.candidates) == (PROMPT, TEST, ("add",))
    assert "check" not in build_program(PROMPT, "    return a + b\n")
    assert build_tests(PROMPT, TEST, per_assert=True).test == split_asserts(TEST)


def test_candidate_names():
    # HumanEval: the argument of the top-level check(...) call, whatever else the test calls.
    test = "def check(c):\n    assert poly(c([1]), 2) == 0\n\ncheck(find_zero)"
    assert candidate_names("", test) == ("find_zero",)
    # MBPP-style asserts: the called names the test does not bind, minus builtins; a prompt's stub is a
    # candidate, a prompt's helper with a body is not (the test gets the problem's own, not the program's).
    prompt = 'def helper(x):\n    return x + 1\n\ndef solve(x):\n    "Doc."\n'
    test = "y = len([1])\nassert solve(helper(y)) == 3\nassert other(1) == sorted([1])"
    assert candidate_names(prompt, test) == ("solve", "other")
    assert candidate_names("", "this is not python") == ()
    # A stub named like a builtin is the program's: the test must not call the builtin instead (which
    # would pass "assert sum([1, 2]) == 3" without any program).
    prompt = 'def sum(xs):\n    """Total of xs."""\n'
    assert candidate_names(prompt, "assert sum([1, 2]) == 3\nassert len([1]) == 1") == ("sum",)


def test_split_asserts_records_each_case():
    # An identity-like bug: add returns a, so case 1 (1 + 2 == 3) fails and case 2 (0 + 0 == 0) passes.
    program = build_program(PROMPT, "    return a\n") + split_asserts(TEST)
    namespace: dict = {}
    exec(compile(program, "p", "exec"), namespace)  # trusted: the failing assert is recorded, not raised
    assert namespace[CASES_NAME] == ["failed", "passed"]
    # reward with fraction: 1 passed of 2 cases = 0.5
    assert code_reward(CodeOutcome.FAILED, 1, 2, fraction=True) == 0.5


def test_split_asserts_keeps_setup_and_records_errors():
    test = (
        "def check(candidate):\n"
        "    data = [1, 2]\n"  # setup: no assert, runs as it is
        "    for x in data:\n"  # a loop holding asserts is one case
        "        assert candidate(x, 0) == x\n"
        "    assert candidate('a', 1) == 'a1'\n"  # TypeError in the candidate: an error case
        "\ncheck(add)"
    )
    namespace: dict = {}
    exec(compile(PROMPT + "    return a + b\n\n" + split_asserts(test), "p", "exec"), namespace)
    assert namespace[CASES_NAME] == ["passed", "error"]


def test_split_asserts_gives_no_credit_for_constant_asserts():
    # HumanEval writes `assert True, "..."` between its cases: kept as code, not counted as a case.
    test = "def check(candidate):\n    assert True, 'free'\n    assert candidate(1, 1) == 2\n\ncheck(add)"
    namespace: dict = {}
    exec(compile(PROMPT + "    return 0\n\n" + split_asserts(test), "p", "exec"), namespace)
    assert namespace[CASES_NAME] == ["failed"]  # 0 of 1 cases, not 1 of 2


def test_split_asserts_leaves_tests_it_cannot_split():
    assert split_asserts("def check(c):\n    pass\ncheck(f)") == "def check(c):\n    pass\ncheck(f)"
    assert split_asserts("this is not python") == "this is not python"
    assert split_asserts("assert f(1) == 1") == "assert f(1) == 1"  # no check()


@pytest.mark.parametrize(
    "outcome,passed,total,fraction,expected",
    [
        (CodeOutcome.PASSED, 0, 0, False, 1.0),
        (CodeOutcome.FAILED, 0, 0, False, 0.0),
        (CodeOutcome.FAILED, 3, 4, True, 0.75),  # 3 of 4 cases
        (CodeOutcome.FAILED, 3, 4, False, 0.0),  # without fraction a failed case fails the whole
        (CodeOutcome.PASSED, 0, 0, True, 1.0),  # no split cases: counts whole
        (CodeOutcome.TIMEOUT, 2, 4, True, 0.0),  # stopped early: no partial credit
        (CodeOutcome.LIMIT_MEMORY, 0, 0, False, 0.0),
        (CodeOutcome.ERROR, 1, 4, True, 0.25),  # 1 case passed, the others failed or raised
        (CodeOutcome.SANDBOX_FAILURE, 0, 0, False, None),  # unscorable, never 0
    ],
)
def test_code_reward(outcome, passed, total, fraction, expected):
    assert code_reward(outcome, passed, total, fraction=fraction) == expected


# --- labels in the scorer ----------------------------------------------------------------------------------


def labelling_fn(prompts, completions, answers, **_):
    """A real labelling function: 1 for a completion "ok", else 0, labelled by what it saw."""
    labels = ["good" if c == "ok" else "bad" for c in completions]
    return LabelledRewards([1.0 if x == "good" else 0.0 for x in labels], labels, ("good", "bad", "never"))


def sleepy_code_exec(prompts, completions, answers, **_):
    """Stands in the pool for code_exec's name: it outlives the pool's budget on "hang"."""
    if completions[0] == "hang":
        time.sleep(30)
    return LabelledRewards([1.0], ["passed"], BUILTIN_REWARDS["code_exec"].kinds)


def test_labels_are_counted_per_kind_zeros_included():
    result = score(
        [RewardSpec("lab")],
        ["p"] * 3,
        ["ok", "no", "ok"],
        ["a"] * 3,
        timeout_s=5,
        functions={"lab": labelling_fn},
    )
    assert result.total == [1.0, 0.0, 1.0]
    assert result.labels == {"lab/good": 2, "lab/bad": 1, "lab/never": 0}


def test_labelled_rewards_checks_its_labels():
    with pytest.raises(ValueError, match="labels"):
        LabelledRewards([1.0], ["a", "b"], ("a", "b"))
    with pytest.raises(ValueError, match="kinds"):
        LabelledRewards([1.0], ["c"], ("a", "b"))


def test_a_pool_failure_of_code_exec_is_unscorable_not_zero():
    # The pool's budget runs out on completion 1: infrastructure, so None (advantage 0), counted twice over.
    with RewardPool(max_workers=2, preload=()) as pool:
        result = score(
            [RewardSpec("code_exec")],
            ["p", "p"],
            ["fine", "hang"],
            ["t", "t"],
            timeout_s=3,
            pool=pool,
            functions={"code_exec": sleepy_code_exec},
        )
    assert result.total == [1.0, None]
    assert result.timeouts == 1 and result.unscorable == 1
    assert result.labels["code_exec/passed"] == 1
    assert result.labels["code_exec/sandbox_failure"] == 1


def test_code_exec_metric_keys_match_the_outcomes():
    assert M.CODE_EXEC_OUTCOMES == [f"train/rewards/code_exec/{k.value}" for k in CodeOutcome]
    assert tuple(k.value for k in CodeOutcome) == BUILTIN_REWARDS["code_exec"].kinds


# --- data --------------------------------------------------------------------------------------------------


def write_code_records(path, records):
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "wt") as handle:
        handle.writelines(json.dumps(r) + "\n" for r in records)


RECORDS = [
    {"task_id": f"T/{i}", "prompt": PROMPT, "test": TEST.rsplit("\n", 1)[0], "entry_point": "add"}
    for i in range(5)
]


def test_jsonl_field_mapping_builds_the_test_call(tmp_path):
    path = tmp_path / "code.jsonl.gz"
    write_code_records(path, RECORDS)
    examples = load_split(
        "jsonl",
        split="train",
        train_path=path,
        question_field="prompt",
        answer_field="test",
        entry_point_field="entry_point",
    )
    assert len(examples) == 5
    assert examples[0].question == PROMPT  # a code prompt keeps its whitespace
    assert examples[0].answer.endswith("\n\ncheck(add)")


def test_humaneval_preset_carves_train_from_its_one_file(tmp_path):
    path = tmp_path / "he.jsonl.gz"
    write_code_records(path, RECORDS)
    data = compose_config(["data=humaneval", f"data.eval_path={path}", "data.eval_size=2"]).data
    train, evaluation = load_data(data)
    assert (len(train), len(evaluation)) == (3, 2)
    assert not {e.id for e in train} & {e.id for e in evaluation}
    assert train[0].answer.endswith("\n\ncheck(add)") and train[0].columns["entry_point"] == "add"


def test_a_bad_entry_point_names_the_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    write_code_records(path, [{**RECORDS[0], "entry_point": "not a name"}])
    with pytest.raises(Exception, match="bad.jsonl:1: entry point"):
        load_eval_split(compose_config(["data=humaneval", f"data.eval_path={path}"]).data)


# --- config ------------------------------------------------------------------------------------------------


def test_code_exec_and_humaneval_compose():
    cfg = compose_config(["reward=code_exec", "data=humaneval"])
    assert cfg.reward.workers == 2
    assert cfg.reward.functions[0].name == "code_exec"


@pytest.mark.parametrize(
    "overrides,key",
    [
        (["reward.functions.0.kwargs.wall_s=10"], "reward.functions[0].kwargs.wall_s"),  # not < timeout_s 10
        (["reward.functions.0.kwargs.isolation=docker"], "reward.functions[0].kwargs.isolation"),
        (["reward.functions.0.kwargs.memory_mb=0"], "reward.functions[0].kwargs.memory_mb"),
        (["+reward.functions.0.kwargs.wal_s=1"], "reward.functions[0].kwargs.wal_s"),
        (["reward.workers=0"], "reward.workers"),
    ],
)
def test_bad_code_exec_options_name_the_key(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.").replace("[", r"\[").replace("]", r"\]")):
        compose_config(["reward=code_exec", *overrides])


def test_the_run_pool_is_sized_by_reward_workers_and_skips_math_verify_for_code():
    from grpo_run.config.schema import RewardConfig, RewardFunctionConfig
    from grpo_run.scoring.run_scorer import reward_pool

    code = reward_pool(RewardConfig(functions=[RewardFunctionConfig(name="code_exec")], workers=3))
    assert (code.max_workers, code.preload) == (3, ("grpo_run.sandbox.reward",))
    mixed = [RewardFunctionConfig(name="code_exec"), RewardFunctionConfig(name="math_verifier")]
    assert "math_verify" in reward_pool(RewardConfig(functions=mixed)).preload
