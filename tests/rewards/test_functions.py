"""Worked examples for answer extraction and the reward functions (pure, in-process)."""

import pytest
from math_verify import parse, verify

from grpo_run.rewards import (
    RewardName,
    extract_answer,
    extract_gold,
    format_reward,
    math_verifier,
    overlong_penalty,
    target_char_fraction,
)
from grpo_run.scoring import BUILTIN_REWARDS, get_reward_fn


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (r"so \boxed{\frac{1}{2}}", r"\frac{1}{2}"),  # nested braces
        (r"\boxed{\frac{\sqrt{2}}{2}}", r"\frac{\sqrt{2}}{2}"),  # deeper nesting
        (r"first \boxed{3}, then \boxed{4}", "4"),  # last box wins
        (r"\boxed{\boxed{5}}", "5"),  # a box around a box is unwrapped
        (r"\fbox{7} then \boxed {8}", "8"),  # \fbox counts, space before { allowed
        (r"\boxed{\{1, 2\}}", r"\{1, 2\}"),  # escaped braces are text
        (r"\boxed{ 12 } and later 99", "12"),  # a box beats any later number
        ("The total is 1,234 dollars.", "1234"),  # thousands comma removed
        ("= -1,000,000", "-1000000"),
        ("It is -7.", "-7"),  # negative; the sentence's full stop is not a decimal point
        ("3 - 7 = -4, so 3-7", "7"),  # the minus of 3-7 is an operator
        ("pi is 3.14", "3.14"),
        ("about .5", ".5"),
        ("ratio is 3/4.", "3/4"),  # fraction
        ("1,23", "23"),  # not a thousands group: two numbers
        ("1,2,3", "3"),
        ("it takes 18km", "18"),  # a unit may follow
        ("call it x2", None),  # digits glued after a letter are a name, not a number
        ("no answer here", None),
        ("", None),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_empty_box_is_no_answer_and_falls_back_to_the_text():
    assert extract_answer(r"\boxed{}") is None
    assert extract_answer(r"\boxed{  }") is None
    # the empty box is ignored; the last number elsewhere is the fallback
    assert extract_answer(r"The answer is 42. \boxed{}") == "42"
    # an empty last box does not hide an earlier non-empty one
    assert extract_answer(r"\boxed{6} and \boxed{}") == "6"


def test_unclosed_box_is_not_a_box():
    assert extract_answer(r"\boxed{12") == "12"  # via the last-number fallback
    assert extract_answer(r"\boxed{12", fallback_last_number=False) is None


def test_no_fallback_means_box_only():
    assert extract_answer("the answer is 42", fallback_last_number=False) is None
    assert extract_answer(r"\boxed{42}", fallback_last_number=False) == "42"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Natalia sold 48+24 = <<48+24=72>>72 clips.\n#### 72", "72"),
        ("so #### 1,234", "1234"),  # GSM8K thousands comma
        ("  \\frac{1}{2} ", "\\frac{1}{2}"),  # otherwise just stripped
        ("1,-2", "1,-2"),  # a MATH list answer keeps its commas
        ("3, 5, 7", "3, 5, 7"),
    ],
)
def test_extract_gold(text, expected):
    assert extract_gold(text) == expected


def _verify(completions, answers, **kwargs):
    return math_verifier(["q"] * len(completions), completions, answers, **kwargs)


def test_math_verifier_numbers():
    completions = [r"\boxed{72}", r"\boxed{72.0}", "so 1,234 in all", r"\boxed{71}", "no idea"]
    answers = ["#### 72", "72", "#### 1,234", "72", "72"]
    assert _verify(completions, answers) == [1.0, 1.0, 1.0, 0.0, 0.0]


def test_math_verifier_latex_golds():
    completions = [
        r"\boxed{\frac{1}{2}}",
        r"\boxed{0.5}",
        r"\boxed{3/4}",
        r"\boxed{\frac34}",
        r"\boxed{0.75}",
    ]
    answers = [r"\frac{1}{2}", r"\frac{1}{2}", r"\dfrac{3}{4}", r"\dfrac{3}{4}", r"\dfrac{3}{4}"]
    # math-verify 0.9 pinned: \frac{1}{2} and 0.5 are equal (both become the rational 1/2), both ways round
    assert _verify(completions, answers) == [1.0, 1.0, 1.0, 1.0, 1.0]
    assert _verify([r"\boxed{\frac{1}{2}}"], ["0.5"]) == [1.0]
    assert _verify([r"\boxed{\frac{1}{3}}"], ["0.5"]) == [0.0]


def test_math_verifier_other_math_golds():
    completions = [r"\boxed{\left(3, \frac{\pi}{2}\right)}", r"\boxed{x = 5}", r"\boxed{-2, 1}"]
    answers = [r"\left( 3, \frac{\pi}{2} \right)", "x=5", "1,-2"]
    assert _verify(completions, answers) == [1.0, 1.0, 1.0]


def test_restating_the_question_earns_nothing():
    completion = "What is 43 + 5? 43 + 5"
    # the trap: math-verify evaluates the bare expression, so the whole completion "verifies" as 48
    assert verify(parse("$48$"), parse(completion))
    # we verify only the extracted final answer: the last number, 5
    assert extract_answer(completion) == "5"
    assert _verify([completion], ["48"]) == [0.0]
    assert _verify([completion], ["48"], fallback_last_number=False) == [0.0]


def test_fallback_switch():
    assert _verify(["the answer is 48"], ["48"]) == [1.0]
    assert _verify(["the answer is 48"], ["48"], fallback_last_number=False) == [0.0]


def test_unparseable_gold_is_unscorable_never_correct():
    # a gold that does not parse gives None, even for a completion that copies it
    assert _verify([r"\boxed{\frac{}", "", "hello"], [r"\frac{", "", "  "]) == [None, None, None]


def test_format_reward():
    completions = [
        r"so \boxed{5}",
        r"\boxed{}",
        r"\boxed{ }",
        "5",
        r"\boxed{5",
        r"\fbox{x}",
        r"\boxed{} \boxed{2}",
    ]
    assert format_reward(["q"] * 7, completions, ["5"] * 7) == [1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0]


def test_overlong_penalty_worked_numbers():
    # max 100, buffer 20 → safe length 80; inside the buffer the penalty is -(L - 80) / 20 · factor
    lengths = [10, 80, 81, 90, 95, 99, 100, 130]
    expected = [0.0, 0.0, -0.05, -0.5, -0.75, -0.95, -1.0, -1.0]
    got = overlong_penalty(
        [""] * 8, [""] * 8, [""] * 8, completion_lengths=lengths, max_new_tokens=100, buffer_length=20
    )
    assert got == pytest.approx(expected)
    # factor 0.5 halves it: L = 90 → -(10 / 20) · 0.5 = -0.25; L = 100 → -0.5
    got = overlong_penalty(
        [""] * 2,
        [""] * 2,
        [""] * 2,
        completion_lengths=[90, 100],
        max_new_tokens=100,
        buffer_length=20,
        penalty_factor=0.5,
    )
    assert got == pytest.approx([-0.25, -0.5])


def test_overlong_penalty_rejects_bad_arguments():
    with pytest.raises(ValueError, match="buffer_length"):
        overlong_penalty([""], [""], [""], completion_lengths=[1], max_new_tokens=10, buffer_length=0)
    with pytest.raises(ValueError, match="buffer_length"):
        overlong_penalty([""], [""], [""], completion_lengths=[1], max_new_tokens=10, buffer_length=11)
    with pytest.raises(ValueError, match="completion_lengths"):
        overlong_penalty([""], [""], [""], completion_lengths=[1, 2], max_new_tokens=10, buffer_length=5)


def test_target_char_fraction():
    completions = ["aaaa", "abab", "bbbb", "", "aAa "]
    # 4/4, 2/4, 0/4, empty → 0, 2/4 (case matters, spaces count)
    assert target_char_fraction([""] * 5, completions, [""] * 5) == [1.0, 0.5, 0.0, 0.0, 0.5]
    assert target_char_fraction([""], ["xyzx"], [""], target="x") == [0.5]
    with pytest.raises(ValueError, match="single character"):
        target_char_fraction([""], ["ab"], [""], target="ab")


def test_functions_ignore_keywords_they_do_not_use():
    assert format_reward(["q"], [r"\boxed{1}"], ["1"], completion_lengths=[3], target="a") == [1.0]


def test_registry():
    assert set(BUILTIN_REWARDS) == {name.value for name in RewardName}
    assert get_reward_fn("math_verifier") is math_verifier
    assert get_reward_fn(RewardName.FORMAT) is format_reward
    assert get_reward_fn("target_char_fraction") is target_char_fraction
    with pytest.raises(ValueError, match="unknown reward function 'acc'.*math_verifier.*format"):
        get_reward_fn("acc")


def test_math_verifier_refuses_a_thread():
    import threading

    errors = []

    def run():
        try:
            _verify([r"\boxed{1}"], ["1"])
        except RuntimeError as error:
            errors.append(str(error))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert errors and "main thread" in errors[0]


def test_reward_modules_stay_pure():
    """House rule 1: no torch, config, logging or distributed imports in the reward package."""
    import ast
    from pathlib import Path

    banned = ("torch", "omegaconf", "hydra", "deepspeed", "logging", "wandb")
    package = Path(__file__).resolve().parents[2] / "grpo_run" / "rewards"
    for path in package.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                assert name.split(".")[0] not in banned, f"{path.name} imports {name}"
