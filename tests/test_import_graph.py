"""The package graph has no loops: between subpackages of grpo_run, and between modules.

The graph is read from the source (every `import` and `from ... import`, function-level ones included), so a
lazy import that closes a loop fails here even though Python would only trip over it on some import order.
A node of the package graph is a subpackage (`grpo_run.config`) or a top-level module (`grpo_run.trainer`).
Importing `grpo_run.a.b` counts as an edge to `grpo_run.a.b` only, not to the package `grpo_run.a` whose
`__init__` Python also runs: a package's `__init__` re-exporting its own modules is no loop.
"""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "grpo_run"


def module_files() -> dict[str, Path]:
    mods = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return mods


MODULES = module_files()


def _nearest_module(name: str) -> str | None:
    while name not in MODULES and "." in name:
        name = name.rsplit(".", 1)[0]
    return name if name in MODULES else None


def imports_of(module: str) -> set[tuple[str, int]]:
    """(imported grpo_run module, line) for every import statement in `module`, at any depth."""
    path = MODULES[module]
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            # `from grpo_run.x import y` imports the module grpo_run.x.y when there is one
            targets = [
                f"{source}.{a.name}" if f"{source}.{a.name}" in MODULES else source for a in node.names
            ]
        else:
            continue
        for target in targets:
            if target == "grpo_run" or not target.startswith("grpo_run."):
                continue  # grpo_run/__init__ only holds the version
            resolved = _nearest_module(target)
            if resolved and resolved != module:
                found.add((resolved, node.lineno))
    return found


def module_graph() -> dict[str, dict[str, list[str]]]:
    """module -> imported module -> ["module:line", ...] (where the import is written)."""
    graph: dict[str, dict[str, list[str]]] = {m: {} for m in MODULES}
    for module in MODULES:
        for target, line in sorted(imports_of(module)):
            graph[module].setdefault(target, []).append(f"{module}:{line}")
    return graph


def node_of(module: str) -> str:
    """The package-graph node of a module: grpo_run.<subpackage> or the top-level module itself."""
    return ".".join(module.split(".")[:2])


def package_graph() -> dict[str, dict[str, list[str]]]:
    graph: dict[str, dict[str, list[str]]] = {}
    for module, targets in module_graph().items():
        for target, where in targets.items():
            a, b = node_of(module), node_of(target)
            graph.setdefault(a, {})
            graph.setdefault(b, {})
            if a != b:
                graph[a].setdefault(b, []).extend(f"{w} -> {target}" for w in where)
    return graph


def cycles(graph: dict[str, dict[str, list[str]]]) -> list[list[str]]:
    """The strongly connected components with more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph) + 100))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def explain(graph: dict[str, dict[str, list[str]]], component: list[str]) -> str:
    members = set(component)
    lines = [" <-> ".join(component)]
    for a in component:
        for b, where in sorted(graph[a].items()):
            if b in members:
                lines.append(f"  {a} -> {b}: {', '.join(where)}")
    return "\n".join(lines)


def test_the_scan_sees_lazy_and_relative_imports():
    # config/checks/reward.py imports the reward names inside a function; report.py imports seeds at the top
    assert "grpo_run.rewards.names" in module_graph()["grpo_run.config.checks.reward"]
    assert "grpo_run.tracking.seeds" in module_graph()["grpo_run.tracking.report"]
    # A loop written into a graph is found, with the lines that make it.
    graph = {"a": {"b": ["a.x:3"]}, "b": {"c": ["b.y:1"]}, "c": {"a": ["c.z:9"]}, "d": {"a": ["d:1"]}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert "a -> b: a.x:3" in explain(graph, ["a", "b", "c"])


def test_no_loop_between_subpackages():
    graph = package_graph()
    assert {"grpo_run.config", "grpo_run.rewards", "grpo_run.sandbox", "grpo_run.scoring"} <= set(graph)
    found = cycles(graph)
    assert not found, "import loops between subpackages:\n" + "\n".join(explain(graph, c) for c in found)


def test_no_loop_between_modules():
    graph = module_graph()
    found = cycles(graph)
    assert not found, "import loops between modules:\n" + "\n".join(explain(graph, c) for c in found)


def test_algo_and_pure_rewards_import_nothing_above_them():
    # The math sits at the bottom: algo imports only algo; the pure reward modules only algo and rewards.
    graph = package_graph()
    assert set(graph["grpo_run.algo"]) == set()
    assert set(graph["grpo_run.rewards"]) <= {"grpo_run.algo"}


# The modules that once formed loops (rewards <-> sandbox, config <-> data, config <-> rewards, report <->
# seeds): each must import first in a fresh interpreter, in whatever order a user or a worker process
# (RewardPool's preload of grpo_run.sandbox.reward) happens to import it.
FRESH = [
    "grpo_run.sandbox.reward",
    "grpo_run.sandbox.runner",
    "grpo_run.rewards.code",
    "grpo_run.rewards.functions",
    "grpo_run.scoring.registry",
    "grpo_run.scoring.run_scorer",
    "grpo_run.config.schema",
    "grpo_run.config.validation",
    "grpo_run.data.jsonl",
    "grpo_run.data.sources",
    "grpo_run.data.prompts",
    "grpo_run.tracking.report",
    "grpo_run.tracking.seeds",
]


def test_each_module_of_the_former_loops_imports_first_in_a_fresh_interpreter():
    # Each module is imported first, with none of grpo_run loaded: a package import cycle shows as an
    # ImportError only in some orders. One interpreter for all: grpo_run's modules are dropped before
    # each import, while the third-party packages stay loaded (their start-up is seconds; they cannot
    # close a cycle of ours).
    script = (
        "import importlib, sys\n"
        "import torch, transformers, omegaconf, hydra\n"
        "failed = []\n"
        "for m in sys.argv[1:]:\n"
        "    for name in [n for n in sys.modules if n == 'grpo_run' or n.startswith('grpo_run.')]:\n"
        "        del sys.modules[name]\n"
        "    try:\n"
        "        importlib.import_module(m)\n"
        "    except Exception as err:\n"
        "        failed.append(f'{m}: {type(err).__name__}: {err}')\n"
        "print('\\n'.join(failed))\n"
        "sys.exit(1 if failed else 0)\n"
    )
    assert set(FRESH) <= set(MODULES)
    result = subprocess.run(
        [sys.executable, "-c", script, *FRESH], capture_output=True, text=True, cwd=ROOT, timeout=600
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_async_box_is_opened_by_the_run_context_alone():
    """rollout=async lives in grpo_run/asynchronous/ behind rollout.source.RolloutSource: the loop, the
    update, the evaluation and everything else import nothing of it; only the run context builds it."""
    box = "grpo_run.asynchronous"
    openers = {
        module
        for module, imported in module_graph().items()
        if not module.startswith(box) and any(name.startswith(box) for name in imported)
    }
    assert openers == {"grpo_run.run_context"}
    # The worker imports no stage above it: what it shares with the update sits below both.
    worker = module_graph()["grpo_run.asynchronous.worker"]
    assert not {"grpo_run.update", "grpo_run.trainer", "grpo_run.evaluation.held_out"} & set(worker)


def test_evaluation_sits_below_the_run_context():
    """The run context is built from evaluation's parts (held-out sets, a training run's evaluation); mode=eval,
    which builds an eval context, is the door beside entry (grpo_run/eval_mode.py), not part of evaluation."""
    graph = package_graph()
    assert "grpo_run.run_context" not in graph["grpo_run.evaluation"]
    assert "grpo_run.evaluation" in graph["grpo_run.eval_mode"]
    assert "grpo_run.run_context" in graph["grpo_run.eval_mode"]
