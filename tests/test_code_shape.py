"""The package's shape (issue #54): few long functions and few long parameter lists.

Every function and method under grpo_run/ is parsed with `ast`: at most 4 may run over 60 lines and at
most 8 may take more than 8 parameters (self and cls not counted; *args and **kwargs count as one each).
A new offender has to push an old one out, or be split: a helper with a clear name, or a small frozen
dataclass for the settings that travel together. The loop's own modules (trainer.py, update.py,
run_context.py) have no function over 60 lines at all: they are read top to bottom.
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "grpo_run"
MAX_LINES = 60
MAX_PARAMS = 8
MAX_LONG_FUNCTIONS = 4
MAX_MANY_PARAM_FUNCTIONS = 8


def parameter_count(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    a = fn.args
    named = [x for x in a.posonlyargs + a.args + a.kwonlyargs if x.arg not in ("self", "cls")]
    return len(named) + (a.vararg is not None) + (a.kwarg is not None)


def functions(paths: list[Path] | None = None) -> list[tuple[str, int, int]]:
    """(where, lines, parameters) of every function and method in `paths` (default: the whole package)."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")) if paths is None else paths:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = path.relative_to(PACKAGE.parent) if path.is_relative_to(PACKAGE.parent) else path.name
                where = f"{name}:{node.lineno} {node.name}"
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


def test_the_limit_sees_a_long_function(tmp_path):
    # A module with one 61-line function and one of 60: the finder counts the def line and the last one.
    body = "\n".join(f"    x{i} = {i}" for i in range(59))
    module = tmp_path / "m.py"
    module.write_text(f"def long():\n{body}\n    return 0\n\n\ndef short():\n{body}\n")
    lengths = {where.rsplit(" ", 1)[1]: lines for where, lines, _ in functions([module])}
    assert lengths == {"long": 61, "short": 60}


@pytest.mark.parametrize(
    "module",
    ["trainer.py", "update.py", "run_context.py"],
)
def test_the_loops_modules_have_no_function_over_60_lines(module):
    long = [(lines, where) for where, lines, _ in functions([PACKAGE / module]) if lines > MAX_LINES]
    assert not long, f"functions over {MAX_LINES} lines in grpo_run/{module}:\n{listing(long)}"


@pytest.mark.parametrize("name", ["training_batch", "policy_update"])
def test_the_update_takes_its_inputs_as_records(name):
    """The update's entry points take a few typed records (what the step trains on, what stays fixed for
    the run, the models it reads with the loop's stop point, the step's coefficients): at most 6 parameters."""
    params = {where.split()[-1]: count for where, _, count in functions([PACKAGE / "update.py"])}
    assert params[name] <= 6, f"update.{name} takes {params[name]} parameters"
