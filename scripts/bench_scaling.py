"""How a grpo-run step scales with G and with max_new_tokens on the tiny model (one thread).

Each setting is one real `grpo-run` run; the median step time over steps 2.. is plotted against G
(2, 4, 8, 16) and against max_new_tokens (32, 64, 128), once per generation backend (native: our
decoder over a preallocated KV cache; hf: transformers' forward with its dynamic cache), the two
alternating setting by setting. Writes outputs/bench/scaling.png and .md.

    python scripts/bench_scaling.py
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
BASE = dict(group_size=8, max_new_tokens=32)
SWEEPS = {"group_size": [2, 4, 8, 16], "max_new_tokens": [32, 64, 128]}
KEYS = ("perf/step_s", "perf/generate_s", "perf/train_s")
BACKENDS = ("native", "hf")


def run(setting: dict, work: Path, steps: int) -> dict[str, float]:
    run_dir = work / "_".join(f"{k}{v}" for k, v in setting.items())
    cmd = [
        str(Path(sys.executable).parent / "grpo-run"),
        "model=tiny",
        "reward=target_char",
        f"grpo.group_size={setting['group_size']}",
        "trainer.prompts_per_step=4",
        "trainer.micro_batch_size=4",
        f"generation.max_new_tokens={setting['max_new_tokens']}",
        f"backend.decoder={setting['backend']}",
        # The tiny model almost never writes EOS: every completion runs to max_new_tokens.
        f"trainer.max_steps={steps}",
        "trainer.device=cpu",
        "logger=console",
        "logger.console=false",
        "eval.every_steps=0",
        "checkpoint.save_final=false",
        f"hydra.run.dir={run_dir}",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    subprocess.run(cmd, cwd=REPO, env=env, check=True, capture_output=True)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()][1:]
    return {k: statistics.median(r[k] for r in rows) for k in KEYS}


def main() -> None:
    steps = int(os.environ.get("STEPS", "5"))
    out = REPO / "outputs" / "bench"
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, list[tuple[int, dict]]]] = {}  # knob -> backend -> [(value, medians)]
    with tempfile.TemporaryDirectory(dir=out) as tmp:
        for knob, values in SWEEPS.items():
            results[knob] = {b: [] for b in BACKENDS}
            for value in values:
                for backend in BACKENDS:
                    setting = {**BASE, knob: value, "backend": backend}
                    results[knob][backend].append((value, run(setting, Path(tmp), steps)))
                    medians = {k: round(v, 3) for k, v in results[knob][backend][-1][1].items()}
                    print(knob, value, backend, medians, flush=True)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    lines = [
        "| knob | value | backend | step s | generate s | train s | generate s / value |",
        "|---|---|---|---|---|---|---|",
    ]
    for ax, (knob, by_backend) in zip(axes, results.items()):
        for backend, style in zip(BACKENDS, ("-", "--")):
            points = by_backend[backend]
            xs = [x for x, _ in points]
            for key, color in zip(KEYS, ("C0", "C1", "C2")):
                label = f"{key.split('/')[1]} ({backend})"
                ax.plot(xs, [m[key] for _, m in points], style, color=color, marker="o", label=label)
            for x, m in points:
                lines.append(
                    f"| {knob} | {x} | {backend} | {m['perf/step_s']:.3f} | {m['perf/generate_s']:.3f} | "
                    f"{m['perf/train_s']:.3f} | {m['perf/generate_s'] / x:.4f} |"
                )
        ax.set_xlabel(knob)
        ax.set_ylabel("seconds per step (median)")
        ax.set_xscale("log", base=2)
        ax.legend(fontsize=7)
        ax.set_title(f"tiny model, B=4, {'G=8' if knob != 'group_size' else '32 new tokens'}")
    fig.tight_layout()
    fig.savefig(out / "scaling.png", dpi=100)
    (out / "scaling.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"written: {out / 'scaling.png'}")


if __name__ == "__main__":
    main()
