"""rollout=sync against rollout=async, alternating in one script: the same run, timed side by side.

Variants (each a real `grpo-run` process, in this order every round, so the machine's drifting load
touches all alike):
    sync-1t   rollout=sync, one torch thread                      (the default run's setting in tests)
    sync-2t   rollout=sync, two torch threads                     (every core to the one loop)
    async     rollout=async, trainer one thread + worker one thread (rollout.threads=1): the same two
              cores as sync-2t, split between the two sides
    async-2t  rollout=async, trainer two threads + worker one thread (the worker's core is idle while it
              waits for weights; the trainer's second thread takes it then)
    async-recompute  the same, π_behaviour recomputed by the training forward in the worker
                     (rollout.recompute_behaviour_logprobs=true) instead of the decoder's own
Per variant: the wall time of the whole process, the mean step time over steps 2..N (step 1 of an async
run has nothing to overlap with), the trainer's wait for groups (perf/generate_s: under async the wait,
async/trainer_wait_s), its update time, the worker's generation time and idle time, the rows the update
trained (under
trainer.skip_zero_advantage those of groups whose rewards differ; an update's time follows
them, and two runs on different trajectories train different numbers) and the completions' mean length, and the peak RSS of the run's
largest process (ru_maxrss from wait4). --keep DIR keeps each run's folder (its metrics.jsonl).

Like with like is sync-2t against async on a 2-core CPU (the same cores and threads in all); sync-1t
is half the machine.

    python scripts/bench_async.py --size smollm2 --steps 16 --rounds 2 --alternate --variants sync-2t async
    python scripts/bench_async.py --size tiny --steps 12 --rounds 2
    python scripts/bench_async.py --size default --rounds 2 --alternate --variants sync-2t async
    python scripts/bench_async.py --size smollm2-body --steps 40 --rounds 2 --alternate \
        --variants sync-1t async trainer.device=cuda rollout.device=cuda:0

--bandwidth first measures the memory bandwidth one process gets alone and each of two gets side by side
(a 270 MB tensor copied into another for 8 s, one thread each; read + write counted): where the two
sides of an async run contend for it, both slow down.

--size default is the default run itself (`grpo-run` with no overrides: B = 8, 32 steps, the held-out
evaluation before and after); the other sizes skip the evaluation and run --steps steps.

KEY=VALUE arguments, wherever they stand, are grpo-run overrides for every variant (model.autocast_bf16=false:
float32, for a CPU without bf16 instructions, docs/performance.md).
"""

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from omegaconf import OmegaConf

from grpo_run.config.convert import to_config
from grpo_run.config.schema import Config
from grpo_run.update import skips_zero_advantage_rows

REPO = Path(__file__).resolve().parents[1]
GRPO_RUN = str(Path(sys.executable).parent / "grpo-run")

SIZES = {
    "default": [],
    "tiny": [
        "model=tiny",
        "reward=target_char",
        "trainer.prompts_per_step=4",
        "grpo.group_size=8",
        "generation.max_new_tokens=32",
        "trainer.micro_batch_size=16",
        "trainer.lr=5e-3",
        "trainer.lr_scheduler=constant",
    ],
    "smollm2": [
        "model=smollm2-135m",
        "reward=math_verifier",
        "data=arithmetic",
        "trainer.prompts_per_step=4",
        "grpo.group_size=8",
        "generation.max_new_tokens=32",
        "trainer.micro_batch_size=16",
    ],
    # SmolLM2-135M's transformer body with random weights on the tiny tokenizer (bench_vs_trl.py's
    # smollm2-body): SmolLM2's shape where its weights cannot go (a GPU machine without network).
    # fp32 master weights, bf16 autocast, as a GPU run trains.
    "smollm2-body": [
        "model=local",
        "model.dtype=float32",
        "model.autocast_bf16=true",
        "reward=target_char",
        "trainer.prompts_per_step=8",
        "grpo.group_size=8",
        "generation.max_new_tokens=64",
        "trainer.micro_batch_size=32",
    ],
}
VARIANTS = {
    "sync-1t": (1, []),
    "sync-2t": (2, []),
    "async": (1, ["rollout=async", "rollout.threads=1"]),
    "async-2t": (2, ["rollout=async", "rollout.threads=1"]),
    "async-recompute": (
        1,
        ["rollout=async", "rollout.threads=1", "rollout.recompute_behaviour_logprobs=true"],
    ),
}


def run(size: str, steps: int, threads: int, extra: list[str], folder: Path) -> dict:
    shape = [*SIZES[size], f"trainer.max_steps={steps}", "eval.every_steps=0"] if size != "default" else []
    if size == "smollm2-body":
        from bench_vs_trl import model_folder  # this script's folder is on sys.path

        shape.append(f"model.path={model_folder(size)}")
    args = [
        *shape,
        "trainer.device=cpu",
        "logger=console",
        "logger.console=false",
        "checkpoint.save_final=false",
        *extra,
        f"hydra.run.dir={folder}",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1"}
    log = folder.parent / f"{folder.name}.log"
    t = time.perf_counter()
    with log.open("w") as out:
        proc = subprocess.Popen([GRPO_RUN, *args], cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)  # this run's own peak RSS (its largest process)
    wall = time.perf_counter() - t
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"grpo-run failed ({status}):\n{log.read_text()[-3000:]}")
    rows = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines() if x.strip()]
    evals = [r for r in rows if "eval/accuracy" in r]
    rows = [r for r in rows if "perf/step_s" in r]  # training steps (step 0 holds only its evaluation)
    later = rows[1:] or rows

    def mean(key: str) -> float:
        values = [r[key] for r in later if key in r]
        return statistics.fmean(values) if values else float("nan")

    # The rows the update trains, which its time follows: with trainer.skip_zero_advantage in force, those of
    # groups whose rewards differ (two runs on different trajectories train different numbers), else all.
    cfg = to_config(
        OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.load(folder / ".hydra" / "config.yaml"))
    )
    completions = cfg.trainer.prompts_per_step * cfg.grpo.group_size
    skips = skips_zero_advantage_rows(
        cfg.grpo, cfg.trainer, beta=cfg.grpo.beta, entropy_coef=cfg.grpo.entropy_coef
    )

    def trained_rows(r: dict) -> float:
        return (1 - r["train/frac_reward_zero_std"]) * completions if skips else completions

    return {
        "wall_s": wall,
        "step_s": mean("perf/step_s"),
        "generate_or_wait_s": mean("perf/generate_s"),
        "train_s": mean("perf/train_s"),
        "worker_generate_s": mean("async/generate_s"),
        "worker_wait_s": mean("async/generator_wait_s"),
        "weight_sync_s": mean("perf/weight_sync_s"),
        "staleness": mean("async/staleness_mean"),
        "trained_rows": statistics.fmean(trained_rows(r) for r in later),
        "completion_len": mean("train/completion_len_mean"),
        "steps_s": sum(r["perf/step_s"] for r in rows),
        "eval_s": [r["perf/eval_s"] for r in evals],
        "eval_accuracy": [r["eval/accuracy"] for r in evals],
        "reward_last": rows[-1]["train/reward_mean"],
        "peak_rss_gb": usage.ru_maxrss / 2**20,
    }


# One process copying a 270 MB tensor into another for 8 s, one thread: prints GB/s moved (read + write).
COPY_LOOP = """
import time, torch
torch.set_num_threads(1)
a = torch.randn(67_500_000); b = torch.empty_like(a)
b.copy_(a); b.copy_(a)
t, n = time.perf_counter(), 0
while time.perf_counter() - t < 8:
    b.copy_(a); n += 1
print(n * a.numel() * 8 / (time.perf_counter() - t) / 1e9)
"""


def bandwidth() -> dict:
    """GB/s of one copying process alone, then of each of two copying at once."""

    def copies(n: int) -> list[float]:
        procs = [
            subprocess.Popen([sys.executable, "-c", COPY_LOOP], stdout=subprocess.PIPE) for _ in range(n)
        ]
        return [float(p.communicate()[0]) for p in procs]

    return {"alone_gb_s": copies(1)[0], "two_at_once_gb_s": copies(2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--variants", nargs="+", choices=sorted(VARIANTS), default=list(VARIANTS))
    ap.add_argument(
        "--alternate", action="store_true", help="every second round runs the variants in reverse order"
    )
    ap.add_argument("--bandwidth", action="store_true", help="measure the memory bandwidth first (above)")
    ap.add_argument("--out", default=str(REPO / "outputs" / "bench" / "async.json"))
    ap.add_argument("--keep", help="keep each run's folder (metrics.jsonl, log) under this folder")
    ap.add_argument("overrides", nargs="*", help="grpo-run overrides for every variant (KEY=VALUE)")
    # KEY=VALUE words are the overrides wherever they stand: argparse alone would take those after
    # --variants for variant names.
    argv = sys.argv[1:]
    words = [a for a in argv if "=" in a and not a.startswith("-")]
    args = ap.parse_args([a for a in argv if a not in words])
    args.overrides = [*args.overrides, *words]
    results: dict[str, list[dict]] = {name: [] for name in args.variants}
    if args.keep is not None:
        Path(args.keep).mkdir(parents=True, exist_ok=True)
    memory = bandwidth() if args.bandwidth else None
    if memory is not None:
        print(f"memory bandwidth: {json.dumps(memory)}", flush=True)
    with tempfile.TemporaryDirectory() if args.keep is None else contextlib.nullcontext(args.keep) as tmp:
        for r in range(args.rounds):
            order = args.variants[::-1] if args.alternate and r % 2 else args.variants
            for name in order:
                threads, extra = VARIANTS[name]
                folder = Path(tmp) / f"{name}-{r}"
                results[name].append(run(args.size, args.steps, threads, [*args.overrides, *extra], folder))
                print(f"round {r + 1} {name}: {json.dumps(results[name][-1])}", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "bandwidth": memory, "results": results}, indent=1) + "\n")
    cols = [
        "wall_s",
        "step_s",
        "generate_or_wait_s",
        "train_s",
        "worker_generate_s",
        "worker_wait_s",
        "trained_rows",
        "completion_len",
    ]
    shape = "the default run" if args.size == "default" else f"{args.size}, {args.steps} steps"
    print(f"\n{shape}, {args.rounds} round(s); means over rounds (steps 2..N)")
    print("| variant | " + " | ".join(cols) + " | peak RSS GB |")
    print("|---" * (len(cols) + 2) + "|")
    for name, rs in results.items():
        cells = [f"{statistics.fmean(x[c] for x in rs):.3f}" for c in cols]
        print(f"| {name} | " + " | ".join(cells) + f" | {max(x['peak_rss_gb'] for x in rs):.2f} |")


if __name__ == "__main__":
    main()
