"""`env=calculator`: `<calc>EXPRESSION</calc>` in a model turn is evaluated and its value comes back.

The evaluator walks Python's syntax tree of the expression and accepts numbers, + - * / **, unary minus
and plus, and parentheses; nothing is ever `eval`ed. Anything else (a name, an attribute, a call, a
string, a comparison), a result too large, a huge exponent or a division by zero is an error
observation, never an exception: the model reads what went wrong and the run goes on.
"""

import ast
import math
from collections.abc import Sequence
from fractions import Fraction

from grpo_run.data.example import Example
from grpo_run.envs.base import ASSISTANT, EnvResponse, Message
from grpo_run.envs.tags import tagged_block

TAG = "calc"
MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 64  # |b| of a ** b
MAX_BITS = 4096  # numerator and denominator of every intermediate value
# ASCII for the operators a model may write in their typographic form.
TYPOGRAPHIC = str.maketrans({"×": "*", "÷": "/", "−": "-", "–": "-"})


class CalcError(ValueError):
    """The expression is not plain arithmetic, or its value is out of bounds."""


_BINARY = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: _divide(a, b),
    ast.Pow: lambda a, b: _power(a, b),
}


def _divide(a: Fraction, b: Fraction) -> Fraction:
    if b == 0:
        raise CalcError("division by zero")
    return a / b


def _power(a: Fraction, b: Fraction) -> Fraction:
    if b.denominator != 1:
        raise CalcError("only whole exponents")
    if abs(b) > MAX_EXPONENT:
        raise CalcError(f"exponent {b} is beyond ±{MAX_EXPONENT}")
    if a == 0 and b < 0:
        raise CalcError("division by zero")
    bits = max(a.numerator.bit_length(), a.denominator.bit_length()) * abs(int(b))
    if bits > MAX_BITS:
        raise CalcError("the result is too large")
    return a ** int(b)


def _checked(value: Fraction) -> Fraction:
    if max(value.numerator.bit_length(), value.denominator.bit_length()) > MAX_BITS:
        raise CalcError("the result is too large")
    return value


def _walk(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        if isinstance(node.value, float) and not math.isfinite(node.value):
            raise CalcError("not a finite number")
        return _checked(Fraction(node.value))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _walk(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        return _checked(_BINARY[type(node.op)](_walk(node.left), _walk(node.right)))
    raise CalcError(f"not arithmetic: {type(node).__name__} (numbers, + - * / **, parentheses only)")


def evaluate(expression: str) -> Fraction:
    """The exact value of an arithmetic expression; CalcError for anything else."""
    text = expression.translate(TYPOGRAPHIC).strip()
    if len(text) > MAX_EXPRESSION_CHARS:
        raise CalcError(f"longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise CalcError("not a valid expression") from None
    try:
        return _walk(tree.body)
    except RecursionError:
        raise CalcError("nested too deeply") from None


def format_value(value: Fraction) -> str:
    """An integer as it is; otherwise a decimal of at most 10 significant digits."""
    if value.denominator == 1:
        return str(value.numerator)
    return f"{float(value):.10g}"


def calculate(expression: str) -> tuple[str, bool]:
    """(observation, error) for one call."""
    try:
        return format_value(evaluate(expression)), False
    except CalcError as err:
        return f"error: {err}", True
    except (OverflowError, ZeroDivisionError, MemoryError, RecursionError) as err:
        return f"error: {type(err).__name__}", True


class Calculator:
    """The latest model turn's `<calc>…</calc>` evaluated; a turn without one ends the episode."""

    def __init__(self, tag: str = TAG) -> None:
        self.tag = tag

    def calls_tool(self, example: Example, turns: Sequence[Message]) -> bool:
        return tagged_block(turns[-1].content, self.tag) is not None

    def step(self, example: Example, turns: Sequence[Message]) -> EnvResponse:
        last = turns[-1]
        assert last.role == ASSISTANT
        expression = tagged_block(last.content, self.tag)
        if expression is None:
            return EnvResponse()  # the final answer: reward= scores it
        text, error = calculate(expression)
        return EnvResponse(observation=text, tool_called=True, tool_error=error)
