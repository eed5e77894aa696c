"""House rule 1: the math in grpo_run/algo and the pure modules of grpo_run/rewards is pure (no distributed,
config, logging, I/O, host syncs).

The rule on imports is an allow-list: algo imports torch, the standard library (less its I/O and process
modules) and algo itself; the pure reward modules may also import each other and the checkers they wrap:
math-verify (`math_verifier`) and reasoning-gym's (`reasoning_gym`). Lazy imports inside functions count.
"""

import ast
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "grpo_run"
ALGO_MODULES = sorted((PACKAGE / "algo").glob("*.py"))
# rewards/ holds only pure modules; the table, the worker pool and the run's scorer are grpo_run/scoring.
REWARD_MODULES = sorted((PACKAGE / "rewards").glob("*.py"))
MODULES = ALGO_MODULES + REWARD_MODULES
BANNED_MODULES = ("torch.distributed", "omegaconf", "hydra", "deepspeed", "logging")
# Standard-library modules that do I/O, start processes or read the environment.
IO_STDLIB = {"io", "os", "pathlib", "shutil", "socket", "subprocess", "multiprocessing", "tempfile", "signal"}
ALLOWED = {
    "algo": ("torch", "grpo_run.algo"),
    "rewards": ("torch", "grpo_run.algo", "grpo_run.rewards", "math_verify", "reasoning_gym"),
}
BANNED_CALLS = {"item", "print", "open"}


def _ids(path: Path) -> str:
    return f"{path.parent.name}/{path.name}"


def allowed(name: str, package: str) -> bool:
    top = name.split(".")[0]
    if top in sys.stdlib_module_names and top != "grpo_run":
        return top not in IO_STDLIB
    return any(name == a or name.startswith(a + ".") for a in ALLOWED[package])


def imported_names(tree):
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield node.module
            # `from torch import distributed` imports torch.distributed too
            yield from (f"{node.module}.{alias.name}" for alias in node.names)


def banned(name):
    return any(name == b or name.startswith(b + ".") for b in BANNED_MODULES)


def test_modules_found():
    assert {p.name for p in ALGO_MODULES} >= {
        "advantages.py",
        "enums.py",
        "kl.py",
        "losses.py",
        "logprobs.py",
        "kl_control.py",
    }
    assert {p.name for p in REWARD_MODULES} >= {"code.py", "extract.py", "functions.py", "names.py"}


@pytest.mark.parametrize("path", MODULES, ids=_ids)
def test_no_banned_imports(path):
    tree = ast.parse(path.read_text(), filename=str(path))
    assert [n for n in imported_names(tree) if banned(n)] == []


@pytest.mark.parametrize("path", MODULES, ids=_ids)
def test_imports_only_torch_the_stdlib_and_its_own_layer(path):
    tree = ast.parse(path.read_text(), filename=str(path))
    package = path.parent.name
    assert [n for n in imported_names(tree) if not allowed(n, package)] == []


def test_the_allow_list_rejects_what_it_should():
    assert allowed("torch.nn.functional", "algo") and allowed("collections.abc", "algo")
    assert not allowed("omegaconf", "algo") and not allowed("grpo_run.config.schema", "algo")
    assert not allowed("grpo_run.rewards.code", "algo") and not allowed("os", "algo")
    assert allowed("math_verify.errors", "rewards") and allowed("grpo_run.rewards.extract", "rewards")
    assert not allowed("grpo_run.sandbox.runner", "rewards") and not allowed("subprocess", "rewards")


@pytest.mark.parametrize("path", MODULES, ids=_ids)
def test_no_item_print_or_open_calls(path):
    tree = ast.parse(path.read_text(), filename=str(path))
    calls = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
            if name in BANNED_CALLS:
                calls.append(f"{path.name}:{node.lineno} {name}()")
    assert calls == []


@pytest.mark.parametrize("path", MODULES, ids=_ids)
def test_no_string_getattr(path):
    # house rule 4: swappable pieces are Enum -> function tables, never getattr by name
    tree = ast.parse(path.read_text(), filename=str(path))
    assert not [
        n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "getattr"
    ]
