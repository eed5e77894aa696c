"""env=calculator: plain arithmetic is evaluated exactly; anything else is an error observation."""

import pytest

from grpo_run.data.example import Example
from grpo_run.envs.base import Message
from grpo_run.envs.calculator import Calculator, calculate

EXAMPLE = Example("What is 123 * 45?", "5535", "0")


@pytest.mark.parametrize(
    "expression,value",
    [
        ("123 * 45", "5535"),
        ("2 + 3 * 4", "14"),  # precedence: 2 + 12
        ("(2 + 3) * 4", "20"),
        ("-2 ** 2", "-4"),  # Python's precedence: -(2 ** 2)
        ("(-2) ** 3", "-8"),
        ("7 / 2", "3.5"),
        ("1 / 3", "0.3333333333"),  # exact 1/3, shown with 10 significant digits
        ("6 / 3", "2"),  # an exact integer quotient prints as one
        ("2 ** -2", "0.25"),
        ("0.1 + 0.2", "0.3"),
        ("12 × 3 − 6 ÷ 2", "33"),  # typographic operators
        ("--5", "5"),
        ("+5", "5"),
    ],
)
def test_arithmetic_is_evaluated(expression, value):
    assert calculate(expression) == (value, False)


@pytest.mark.parametrize(
    "expression,why",
    [
        ("__import__('os').system('true')", "Call"),
        ("x + 1", "Name"),
        ("(1).real", "Attribute"),
        ("abs(-1)", "Call"),
        ("'a' * 3", "Constant"),  # a string is not a number
        ("True + 1", "Constant"),  # neither is a bool
        ("1 < 2", "Compare"),
        ("[1, 2]", "List"),
        ("lambda: 1", "Lambda"),
        ("7 // 2", "BinOp"),  # floor division is not one of the operators
        ("7 % 2", "BinOp"),
        ("2 ** 1000000", "exponent"),
        ("9 ** 9 ** 9", "exponent"),
        ("(10 ** 60) ** 60", "too large"),  # each exponent is small, the value is not
        ("2 ** 0.5", "whole exponents"),
        ("1 / 0", "division by zero"),
        ("0 ** -1", "division by zero"),
        ("1e999", "finite"),
        ("1 +", "not a valid expression"),
        ("(" * 500 + "1" + ")" * 500, "longer than"),
        ("", "not a valid expression"),
    ],
)
def test_anything_else_is_an_error_observation(expression, why):
    text, error = calculate(expression)
    assert error and text.startswith("error: ") and why in text


def test_deep_nesting_is_an_error_not_a_crash():
    text, error = calculate("-" * 190 + "1")  # unary chains within the length bound
    assert error is False and text == "1"


def test_the_environment_answers_a_call_and_ends_on_a_plain_answer():
    env = Calculator()
    r = env.step(EXAMPLE, [Message("assistant", "Let me compute. <calc>123*45</calc>")])
    assert (r.observation, r.tool_called, r.tool_error) == ("5535", True, False)
    r = env.step(
        EXAMPLE, [Message("assistant", "<calc>123*45"), Message("tool", "5535"), Message("assistant", "5535")]
    )
    assert r.observation is None and r.reward is None  # the final answer: reward= scores it
    r = env.step(EXAMPLE, [Message("assistant", "<calc>open('/etc/passwd')</calc>")])
    assert r.tool_called and r.tool_error and r.observation.startswith("error: not arithmetic")
