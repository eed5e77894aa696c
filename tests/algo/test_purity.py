"""House rule 1: the math in grpo_run/algo is pure (no distributed, config, logging, I/O, host syncs)."""

import ast
from pathlib import Path

import pytest

ALGO = Path(__file__).resolve().parents[2] / "grpo_run" / "algo"
MODULES = sorted(ALGO.glob("*.py"))
BANNED_MODULES = ("torch.distributed", "omegaconf", "hydra", "deepspeed", "logging")
BANNED_CALLS = {"item", "print", "open"}


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
    assert {p.name for p in MODULES} >= {
        "advantages.py",
        "kl.py",
        "losses.py",
        "logprobs.py",
        "kl_control.py",
    }


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_no_banned_imports(path):
    tree = ast.parse(path.read_text(), filename=str(path))
    assert [n for n in imported_names(tree) if banned(n)] == []


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
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


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_no_string_getattr(path):
    # house rule 4: swappable pieces are Enum -> function tables, never getattr by name
    tree = ast.parse(path.read_text(), filename=str(path))
    assert not [
        n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "getattr"
    ]
