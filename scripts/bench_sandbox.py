"""Scoring throughput of the code_exec reward: completions per second on HumanEval's 164 canonical solutions.

The reward pool (reward.workers processes, started and warmed before the clock) scores all 164 solutions
through `score`, as the trainer does; each round alternates the isolation modes (namespaces, audit) so that
the machine's load falls on both alike. Prints a Markdown table (median over rounds).

    flock /tmp/grpo-heavy.lock python scripts/bench_sandbox.py [--workers 2] [--rounds 3]
"""

import argparse
import gzip
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from grpo_run.scoring.pool import RewardPool, RewardSpec, score  # noqa: E402

DATA = Path(os.environ.get("GRPO_RUN_DATA", REPO.parent / "shared" / "data")) / "humaneval_test.jsonl.gz"
MODES = ("namespaces", "audit")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    records = [json.loads(line) for line in gzip.open(DATA, "rt")]
    prompts = [r["prompt"] for r in records]
    completions = [r["canonical_solution"] for r in records]
    tests = [f"{r['test']}\n\ncheck({r['entry_point']})" for r in records]
    rates: dict[str, list[float]] = {mode: [] for mode in MODES}
    with RewardPool(max_workers=args.workers, preload=("grpo_run.sandbox.reward",)) as pool:
        for mode in MODES:  # warm-up: workers started, modules imported, page cache filled
            score(
                [RewardSpec("code_exec", 1.0, {"isolation": mode})],
                prompts[:4],
                completions[:4],
                tests[:4],
                timeout_s=10,
                pool=pool,
            )
        for _ in range(args.rounds):
            for mode in MODES:
                spec = RewardSpec("code_exec", 1.0, {"isolation": mode})
                start = time.perf_counter()
                result = score([spec], prompts, completions, tests, timeout_s=10, pool=pool)
                elapsed = time.perf_counter() - start
                passed = result.labels["code_exec/passed"]
                if passed != len(records):
                    raise SystemExit(f"{mode}: only {passed} of {len(records)} passed: {result.labels}")
                rates[mode].append(len(records) / elapsed)
    print(
        f"machine: {platform.node()} {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end"
    )
    print(f"workers: {args.workers}, rounds: {args.rounds}, completions per round: {len(records)}\n")
    print("| isolation | completions/s (median) | per round |")
    print("|---|---|---|")
    for mode in MODES:
        each = ", ".join(f"{r:.1f}" for r in rates[mode])
        print(f"| {mode} | {statistics.median(rates[mode]):.1f} | {each} |")


if __name__ == "__main__":
    main()
