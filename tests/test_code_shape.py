"""The package's shape (issue #54): few long functions and few long parameter lists.

Every function and method under grpo_run/ is parsed with `ast`: at most 12 may run over 60 lines and at
most 10 may take more than 8 parameters (self and cls not counted; *args and **kwargs count as one each).
A new offender has to push an old one out, or be split: a helper with a clear name, or a small frozen
dataclass for the settings that travel together.
"""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "grpo_run"
MAX_LINES = 60
MAX_PARAMS = 8
MAX_LONG_FUNCTIONS = 12
MAX_MANY_PARAM_FUNCTIONS = 10


def parameter_count(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    a = fn.args
    named = [x for x in a.posonlyargs + a.args + a.kwonlyargs if x.arg not in ("self", "cls")]
    return len(named) + (a.vararg is not None) + (a.kwarg is not None)


def functions() -> list[tuple[str, int, int]]:
    """(where, lines, parameters) of every function and method in the package."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                where = f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name}"
                found.append((where, node.end_lineno - node.lineno + 1, parameter_count(node)))
    return found


def listing(rows: list[tuple[int, str]]) -> str:
    return "\n".join(f"  {count:4d}  {where}" for count, where in sorted(rows, reverse=True))


def test_the_finder_sees_the_package():
    assert len(functions()) > 500  # a wrong folder would pass the limits below with nothing in it


def test_few_functions_run_over_60_lines():
    long = [(lines, where) for where, lines, _ in functions() if lines > MAX_LINES]
    assert len(long) <= MAX_LONG_FUNCTIONS, (
        f"{len(long)} functions over {MAX_LINES} lines (at most {MAX_LONG_FUNCTIONS}):\n{listing(long)}"
    )


def test_few_functions_take_more_than_8_parameters():
    many = [(params, where) for where, _, params in functions() if params > MAX_PARAMS]
    assert len(many) <= MAX_MANY_PARAM_FUNCTIONS, (
        f"{len(many)} functions with more than {MAX_PARAMS} parameters (at most {MAX_MANY_PARAM_FUNCTIONS}):\n"
        f"{listing(many)}"
    )
