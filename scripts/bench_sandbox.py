"""Scoring throughput of the code_exec reward: completions per second on HumanEval's 164 canonical solutions.

The reward pool (reward.workers processes, started and warmed before the clock) scores all 164 solutions
through `score`, as the trainer does. Two comparisons, each alternating round by round so that the
machine's load falls on both sides alike; prints a Markdown table (median over rounds):

- default: the isolation modes (namespaces, audit) of this checkout;
- `--baseline REF`: the sandbox of a git revision (its `grpo_run/`, exported to a temporary folder) against
  this checkout's, in one isolation mode (`--isolation`, default auto). Each round runs each side in a fresh
  process of its own, with the same interpreter.

    flock /tmp/grpo-heavy.lock python scripts/bench_sandbox.py [--workers 2] [--rounds 3]
    python scripts/bench_sandbox.py --baseline main --rounds 5          # make bench-sandbox
"""

import argparse
import gzip
import json
import os
import platform
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from io import BytesIO
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DATA = Path(os.environ.get("GRPO_RUN_DATA", REPO.parent / "shared" / "data")) / "humaneval_test.jsonl.gz"
MODES = ("namespaces", "audit")


def humaneval() -> tuple[list[str], list[str], list[str]]:
    records = [json.loads(line) for line in gzip.open(DATA, "rt")]
    prompts = [r["prompt"] for r in records]
    completions = [r["canonical_solution"] for r in records]
    tests = [f"{r['test']}\n\ncheck({r['entry_point']})" for r in records]
    return prompts, completions, tests


def rates_of(modes: list[str], rounds: int, workers: int) -> dict[str, list[float]]:
    """Completions/s of each mode per round, alternating, in one warmed pool of the code on sys.path."""
    try:  # the package layout of this checkout, or that of a revision from before grpo_run/scoring/
        from grpo_run.scoring import RewardPool, RewardSpec, score
    except ModuleNotFoundError:
        from grpo_run.rewards.scoring import RewardPool, RewardSpec, score

    prompts, completions, tests = humaneval()
    rates: dict[str, list[float]] = {mode: [] for mode in modes}
    with RewardPool(max_workers=workers, preload=("grpo_run.sandbox.reward",)) as pool:
        for mode in modes:  # warm-up: workers started, modules imported, page cache filled
            spec = RewardSpec("code_exec", 1.0, {"isolation": mode})
            score([spec], prompts[:4], completions[:4], tests[:4], timeout_s=10, pool=pool)
        for _ in range(rounds):
            for mode in modes:
                spec = RewardSpec("code_exec", 1.0, {"isolation": mode})
                start = time.perf_counter()
                result = score([spec], prompts, completions, tests, timeout_s=10, pool=pool)
                elapsed = time.perf_counter() - start
                passed = result.labels["code_exec/passed"]
                if passed != len(prompts):
                    raise SystemExit(f"{mode}: only {passed} of {len(prompts)} passed: {result.labels}")
                rates[mode].append(len(prompts) / elapsed)
    return rates


def export(ref: str, into: Path) -> None:
    """`grpo_run/` of a git revision, written under `into`."""
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", "--format=tar", ref, "grpo_run"], check=True, capture_output=True
    ).stdout
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")


def one_round(code: Path, isolation: str, workers: int) -> float:
    """One timed pass of the code under `code`, in a fresh process (the other side's modules never load)."""
    out = subprocess.run(
        [sys.executable, __file__, "--code", str(code), "--isolation", isolation, "--workers", str(workers)],
        check=True,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(code)},
    ).stdout
    return float(out.strip().splitlines()[-1])


def table(rows: dict[str, list[float]], label: str) -> None:
    print(f"| {label} | completions/s (median) | per round |")
    print("|---|---|---|")
    for name, values in rows.items():
        each = ", ".join(f"{r:.1f}" for r in values)
        print(f"| {name} | {statistics.median(values):.1f} | {each} |")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--baseline", help="a git revision whose sandbox is measured against this checkout's")
    parser.add_argument("--isolation", default="auto", help="the mode of the --baseline comparison")
    parser.add_argument("--code", help=argparse.SUPPRESS)  # internal: one pass of the code in this folder
    args = parser.parse_args()
    if args.code:
        sys.path.insert(0, args.code)
        print(rates_of([args.isolation], 1, args.workers)[args.isolation][0])
        return
    load = os.getloadavg()[0]
    if args.baseline:
        rows: dict[str, list[float]] = {args.baseline: [], "this checkout": []}
        with tempfile.TemporaryDirectory(prefix="bench-sandbox-") as folder:
            export(args.baseline, Path(folder))
            sides = {args.baseline: Path(folder), "this checkout": REPO}
            for _ in range(args.rounds):
                for name, code in sides.items():
                    rows[name].append(one_round(code, args.isolation, args.workers))
        label = f"sandbox ({args.isolation})"
    else:
        sys.path.insert(0, str(REPO))
        rows, label = rates_of(list(MODES), args.rounds, args.workers), "isolation"
    print(f"machine: {platform.node()} {os.cpu_count()} CPUs, load average {load:.1f} at the start, ", end="")
    print(f"{os.getloadavg()[0]:.1f} at the end")
    print(f"workers: {args.workers}, rounds: {args.rounds}, completions per round: 164\n")
    table(rows, label)
    if args.baseline:
        base, new = (statistics.median(v) for v in rows.values())
        print(f"\nthis checkout / {args.baseline}: {new / base:.2f}")


if __name__ == "__main__":
    main()
