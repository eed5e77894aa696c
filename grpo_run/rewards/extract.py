"""Pull the final answer out of a completion, and the gold answer out of a dataset field.

Rules for `extract_answer` (what a researcher can rely on):
- The answer is the content of the last non-empty `\\boxed{...}` or `\\fbox{...}`. Braces are matched with
  nesting (`\\boxed{\\frac{1}{2}}` gives `\\frac{1}{2}`); escaped braces `\\{ \\}` count as text. A box nested
  in a box is part of the outer one, and a box whose whole content is another box is unwrapped.
- An empty box (`\\boxed{}` or only whitespace) is treated as if it were not there: it is no answer, and
  it hides nothing either. So "The answer is 42. \\boxed{}" falls back to 42 (when the fallback is on), and
  "\\boxed{}" alone gives None. An unclosed box (`\\boxed{12`) is not a box.
- Fallback: the last number in the text: integers, decimals (`3.5`, `.5`), a leading minus (`-7`; the minus
  of `3-7` is an operator, so that gives `7`), thousands commas (`1,234` gives `1234`; `1,23` is two numbers)
  and simple fractions (`3/4`). Digits right after an ASCII letter (`x2`) are not a number; units right
  after one are fine (`18km` gives 18).
- Nothing found: None.
"""

from __future__ import annotations

import re

_BOX_OPENERS = re.compile(r"\\(?:boxed|fbox)\s*\{")

_NUMBER = re.compile(
    r"""
    (?:(?<![A-Za-z0-9_.)\]}])-|(?<![A-Za-z0-9_.]))   # a sign only when the minus is not an operator
    (?:
        \d{1,3}(?:,\d{3})+(?!\d|,\d)(?:\.\d+)?       # 1,234 or 1,234.5
      | \d+(?:\.\d+)?(?:/\d+(?!\.?\d))?              # 12, 3.5, 3/4 (units may follow: 18km)
      | \.\d+                                        # .5
    )
    """,
    re.VERBOSE,
)

_THOUSANDS = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?")


def _closing_brace(text: str, open_index: int) -> int | None:
    """Index of the `}` that closes the `{` at `open_index`, or None when it never closes."""
    depth = 0
    i = open_index
    while i < len(text):
        char = text[i]
        if char == "\\":
            i += 2  # `\{` and `\}` are literal braces; skip any escaped character
            continue
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    return None


def boxed_contents(text: str) -> list[str]:
    """Stripped contents of every top-level, closed `\\boxed{}` / `\\fbox{}` in order (empty ones included)."""
    contents = []
    position = 0
    while (match := _BOX_OPENERS.search(text, position)) is not None:
        open_index = match.end() - 1
        close_index = _closing_brace(text, open_index)
        if close_index is None:
            position = match.end()
            continue
        contents.append(_unwrap(text[open_index + 1 : close_index].strip()))
        position = close_index + 1
    return contents


def _unwrap(content: str) -> str:
    """`\\boxed{5}` as the whole content of a box is just 5."""
    match = _BOX_OPENERS.match(content)
    if match is not None and _closing_brace(content, match.end() - 1) == len(content) - 1:
        return _unwrap(content[match.end() : -1].strip())
    return content


def last_number(text: str) -> str | None:
    """The last number in `text`, commas removed (`-1,234.5` gives `-1234.5`), or None."""
    numbers = _NUMBER.findall(text)
    if not numbers:
        return None
    return numbers[-1].replace(",", "")


def first_number(text: str) -> str | None:
    """The first number in `text` (the same forms as `last_number`), commas removed, or None."""
    match = _NUMBER.search(text)
    return None if match is None else match.group(0).replace(",", "")


# A binary arithmetic operator between two numbers (or brackets): `43 + 5`, `6\\times7`, `(2+3)*4`.
_BINARY_OPERATION = re.compile(r"[\d)]\s*(?:[-+*×÷^]|\\times|\\cdot|\\div)\s*[\d(]")
_NUMERIC_EXPRESSION = re.compile(r"(?:[\d\s.,+\-*/×÷^()]|\\times|\\cdot|\\div)+")


def is_unevaluated_arithmetic(answer: str) -> bool:
    """True when the answer (the side after its last `=`) is a computation on numbers left undone.

    `43 + 5`, `6 \\times 7`, `48 = 43 + 5` are: math-verify would evaluate them and match the gold, so a
    model could earn the reward by boxing the question. A single number (`-7`, `3.5`, `1,234`), a fraction
    (`3/4`, `\\frac{14}{3}`) and anything with a variable or a function (`x + 1`, `3 - 2i`, `2\\sqrt{3}`) are
    not.
    """
    value = answer.rsplit("=", 1)[-1].replace("$", "").strip()
    return bool(_NUMERIC_EXPRESSION.fullmatch(value)) and bool(_BINARY_OPERATION.search(value))


def extract_answer(text: str, fallback_last_number: bool = True) -> str | None:
    """The completion's final answer: last non-empty box, else (if allowed) the last number, else None."""
    answers = [content for content in boxed_contents(text) if content]
    if answers:
        return answers[-1]
    if fallback_last_number:
        return last_number(text)
    return None


def extract_gold(text: str) -> str:
    """The gold answer: the part after the last `####` (GSM8K) if any, stripped; `1,234` becomes `1234`.

    Commas go only when the whole gold is one number with thousands groups, so a list gold such as
    MATH's `1,-2` or `3, 5, 7` is left alone.
    """
    gold = text.rsplit("####", 1)[-1].strip()
    if _THOUSANDS.fullmatch(gold):
        return gold.replace(",", "")
    return gold
