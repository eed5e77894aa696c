"""Pure parts of the code-execution reward: the code out of a completion, the program to run, the outcome kinds.

The program of one completion is `prompt + code` (the HumanEval convention): the prompt holds the
function's signature and docstring, the completion its body (or a whole function in a fenced block). The
test (the data's `answer`) defines `check(candidate)` and ends with the call `check(<entry_point>)`; it is no
part of the program: the sandbox runs it apart, against a proxy of the program's function (`TestPlan`).
Running either is I/O and lives in `grpo_run.sandbox`; nothing here runs code.
"""

from __future__ import annotations

import ast
import builtins
import re
from dataclasses import dataclass
from enum import StrEnum


class CodeOutcome(StrEnum):
    """What running one completion's program came to; counted as `train/rewards/code_exec/<value>`."""

    PASSED = "passed"  # every test passed (the program reached its end)
    FAILED = "failed"  # an assertion failed
    ERROR = "error"  # an exception other than an assertion (syntax error, NameError, SystemExit, ...)
    TIMEOUT = "timeout"  # past the wall-clock budget or the CPU-time limit
    LIMIT_MEMORY = "limit_memory"  # the address-space limit (MemoryError)
    LIMIT_PROCESSES = "limit_processes"  # the process limit (fork refused)
    LIMIT_FILE_SIZE = "limit_file_size"  # the file-size limit (a write refused)
    LIMIT_OPEN_FILES = "limit_open_files"  # the open-files limit
    SANDBOX_FAILURE = "sandbox_failure"  # the sandbox itself failed: the completion cannot be scored


# One statement per case in `check` whose outcome is recorded by the per-assert variant.
CASES_NAME = "__grpo_cases__"

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)
_PYTHON_TAGS = {"", "python", "py", "python3"}


def extract_code(completion: str) -> str:
    """The code of a completion: the first fenced block tagged python (or untagged), else the bare text.

    - "```python\\ndef f(x):\\n    return x\\n```" -> "def f(x):\\n    return x\\n"
    - "Here:\\n```\\n    return x\\n```" -> "    return x\\n" (an untagged block counts as Python)
    - "    return x\\n" -> "    return x\\n" (a bare body, as a base model continues the prompt)
    An unclosed fence (the completion was cut at max_new_tokens) runs to the end of the text. A block
    tagged with another language ("```bash") is skipped.
    """
    for match in _FENCE.finditer(completion):
        if match.group(1).lower() in _PYTHON_TAGS:
            return match.group(2)
    return completion


def is_body(code: str) -> bool:
    """True when the code's first non-blank line is indented: it continues the prompt's function."""
    for line in code.splitlines():
        if line.strip():
            return line[0] in " \t"
    return True  # empty code: a body that does nothing


def bare_body(code: str) -> str:
    """A body up to the first top-level line: what a base model writes after the function is not run.

    "    return x\\n\\nprint(f(2))\\n" -> "    return x\\n\\n" (a top-level call after the body is cut, as the
    Codex paper's stop sequences do).
    """
    lines = code.splitlines(keepends=True)
    for i, line in enumerate(lines):
        if line.strip() and line[0] not in " \t" and not line.startswith("#"):
            return "".join(lines[:i])
    return code


def build_program(prompt: str, completion: str) -> str:
    """`prompt + code`: the untrusted program of one completion (its tests are never part of it).

    - A body (first line indented) continues the prompt's function: prompt + body (cut at top level).
    - Top-level code (a whole `def ...` in a fenced block) follows the prompt: the prompt's function, a
      signature with only a docstring, is valid Python and is redefined by the completion's; the prompt's
      imports stay.
    """
    code = extract_code(completion)
    code = bare_body(code) if is_body(code) else code
    head = prompt if prompt.endswith("\n") or not prompt else prompt + "\n"
    if not is_body(code):
        head += "\n"
    return f"{head}{code}\n"


@dataclass(frozen=True)
class TestPlan:
    """What the sandbox's judge runs, apart from the program: the prompt (trusted: its helpers, such as
    HumanEval's `poly`, stay the problem's own), then `candidates` bound to proxies of the program's
    functions, then the test."""

    prompt: str
    test: str
    candidates: tuple[str, ...]


def build_tests(prompt: str, test: str, *, per_assert: bool = False) -> TestPlan:
    """The judge's side of one problem; per_assert: `check` records each case (see `split_asserts`)."""
    return TestPlan(prompt, split_asserts(test) if per_assert else test, candidate_names(prompt, test))


def candidate_names(prompt: str, test: str) -> tuple[str, ...]:
    """The names the test calls that are the program's functions (proxied to it; everything else the test
    uses comes from the prompt, the test itself or the builtins).

    - The arguments of top-level `check(<name>)` calls (the HumanEval convention): "...\ncheck(add)" -> ("add",).
    - Without such a call (MBPP-style top-level asserts), the names the test calls but does not bind that
      the prompt defines as a stub (a function whose body is only a docstring or `pass`/`...`), even one
      named like a builtin (`def sum(...)`: the test must call the program's, not the builtin), or that
      are neither the prompt's nor builtins: "assert add(1, 2) == 3" -> ("add",).
    A test that does not parse gives (): it then runs as it is and fails on its own.
    """
    try:
        tree = ast.parse(test)
    except SyntaxError:
        return ()
    checks = [
        node.value.args[0].id
        for node in tree.body
        if isinstance(node, ast.Expr)
        and isinstance(node.value, ast.Call)
        and isinstance(node.value.func, ast.Name)
        and node.value.func.id == "check"
        and len(node.value.args) == 1
        and isinstance(node.value.args[0], ast.Name)
    ]
    if checks:
        return tuple(dict.fromkeys(checks))
    bound = _bound_names(tree)
    helpers, stubs = _prompt_names(prompt)
    called = [
        node.func.id
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
    ]
    free = [
        n
        for n in called
        if n not in bound and (n in stubs or (n not in helpers and not hasattr(builtins, n)))
    ]
    return tuple(dict.fromkeys(free))


def _bound_names(tree: ast.AST) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
    return names


def _prompt_names(prompt: str) -> tuple[set[str], set[str]]:
    """(helpers, stubs): the top-level names the prompt binds other than stub functions, and its stubs
    (the functions the completion writes)."""
    try:
        tree = ast.parse(prompt)
    except SyntaxError:
        return set(), set()
    helpers: set[str] = set()
    stubs: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            (stubs if _is_stub(node) else helpers).add(node.name)
        else:
            helpers |= _bound_names(node)
    return helpers, stubs


def _is_stub(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    return all(
        isinstance(stmt, ast.Pass) or (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant))
        for stmt in node.body
    )


def split_asserts(test: str) -> str:
    """The test with each top-level statement of `check` that holds an `assert` recorded as one case.

    Each such statement becomes `try: <stmt>` / `except AssertionError: record "failed"` / `except Exception:
    record "error"` / `else: record "passed"`, appending to the list `__grpo_cases__`, so one failing case
    does not hide the others; statements without an assert (setup) run as they are, and so do constant
    asserts (`assert True, "..."`, frequent in HumanEval), which would give free credit. The fraction of cases
    passed is the reward of `fraction=true`. A test that does not parse, or has no `check` with asserts,
    is returned unchanged (it then scores as one case).

    Example: `def check(c):\\n    assert c(1) == 1\\n    assert c(2) == 3` becomes a check that appends
    "passed" then "failed" for a correct identity function: fraction 1/2.
    """
    try:
        tree = ast.parse(test)
    except SyntaxError:
        return test
    checks = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "check"]
    if not checks:
        return test
    check = checks[-1]
    cases = [any(_checks_something(n) for n in ast.walk(stmt)) for stmt in check.body]
    if not any(cases):
        return test
    check.body = [
        _recorded(stmt) if is_case else stmt for stmt, is_case in zip(check.body, cases, strict=True)
    ]
    tree.body.insert(0, ast.parse(f"{CASES_NAME} = []").body[0])
    return ast.unparse(ast.fix_missing_locations(tree))


def _checks_something(node: ast.AST) -> bool:
    """An assert whose test is not a constant: HumanEval's `assert True, "..."` lines are no cases."""
    return isinstance(node, ast.Assert) and not isinstance(node.test, ast.Constant)


def _recorded(stmt: ast.stmt) -> ast.stmt:
    def record(outcome: str) -> list[ast.stmt]:
        return ast.parse(f"{CASES_NAME}.append({outcome!r})").body

    return ast.Try(
        body=[stmt],
        handlers=[
            ast.ExceptHandler(type=ast.Name("AssertionError", ast.Load()), name=None, body=record("failed")),
            ast.ExceptHandler(type=ast.Name("Exception", ast.Load()), name=None, body=record("error")),
        ],
        orelse=record("passed"),
        finalbody=[],
    )


def code_reward(outcome: CodeOutcome, passed: int, total: int, *, fraction: bool) -> float | None:
    """The reward of one outcome: 1.0 passed, 0.0 otherwise, None for a sandbox failure (unscorable).

    fraction: the share of cases passed (`passed / total`) when the per-assert variant recorded cases;
    a program that stopped before its cases finished (timeout, a limit, an error outside the cases) keeps
    the cases recorded so far out of it and scores 0.
    Examples: (FAILED, 3, 4, fraction=True) -> 0.75; (FAILED, 3, 4, fraction=False) -> 0.0;
    (PASSED, 0, 0, fraction=True) -> 1.0 (a test without split cases counts whole).
    """
    if outcome is CodeOutcome.SANDBOX_FAILURE:
        return None
    if fraction and total > 0 and outcome in (CodeOutcome.PASSED, CodeOutcome.FAILED, CodeOutcome.ERROR):
        return passed / total
    return 1.0 if outcome is CodeOutcome.PASSED else 0.0
