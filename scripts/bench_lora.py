"""Full fine-tuning vs lora=default at the default run's shape, alternating A/B runs (docs/lora.md).

Each run is its own `grpo-run` process (so ru_maxrss, `perf/peak_mem_gb`, is that run's peak RSS), with
the default config (SmolLM2-135M, 8 prompts x G = 8 x 32 new tokens) for `--steps` steps and no eval.
Step 1 is left out of the timings (first-use allocations). Run it under the heavy lock:

    flock /tmp/grpo-heavy.lock python scripts/bench_lora.py --rounds 2 --steps 4
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

GRPO_RUN = str(Path(sys.executable).parent / "grpo-run")
VARIANTS = {"full": [], "lora": ["lora=default"]}


def one_run(variant: str, steps: int, root: Path, index: int) -> dict[str, float]:
    run_dir = root / f"{index:02d}-{variant}"
    args = [
        f"trainer.max_steps={steps}",
        "eval.every_steps=0",
        "logger=console",
        "logger.console=false",
        "checkpoint.save_final=false",
        f"hydra.run.dir={run_dir}",
        *VARIANTS[variant],
    ]
    subprocess.run([GRPO_RUN, *args], check=True, capture_output=True, text=True)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    timed = rows[1:]
    return {
        "step_s": statistics.mean(r["perf/step_s"] for r in timed),
        "generate_s": statistics.mean(r["perf/generate_s"] for r in timed),
        "train_s": statistics.mean(r["perf/train_s"] for r in timed),
        "peak_rss_gb": max(r["perf/peak_mem_gb"] for r in rows),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-lora-") as tmp:
        index = 0
        for round_ in range(args.rounds):
            for variant in VARIANTS:
                result = one_run(variant, args.steps, Path(tmp), index)
                index += 1
                cells = "  ".join(f"{k} {v:.2f}" for k, v in result.items())
                print(f"round {round_} {variant:4s}  {cells}", flush=True)


if __name__ == "__main__":
    main()
