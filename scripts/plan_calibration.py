"""Measure what `grpo-run mode=plan` estimates: the peak resident memory of each phase of a short real run.

Each setting runs in its own process (in-process `train`, so the phases can be timed from inside): the
baseline is the process's resident set just before the run builds anything (torch, transformers and
grpo_run imported); before each phase (generation, the π_old/π_ref pass, the update) the kernel's peak-RSS
mark is reset (`/proc/self/clear_refs` = 5) and read back after it (`VmHWM`). The estimate is computed by
the plan's own code for the same config. Linux only. Prints a table; writes outputs/plan_calibration/.

    flock /tmp/grpo-heavy.lock python scripts/plan_calibration.py              # every setting (~15 min)
    flock /tmp/grpo-heavy.lock python scripts/plan_calibration.py tiny-bench   # one
    python scripts/plan_calibration.py                # the table again from the stored measurements
    flock /tmp/grpo-heavy.lock python scripts/plan_calibration.py --remeasure  # measure again
"""

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
QUIET = [
    "logger=console",
    "logger.console=false",
    "eval.every_steps=0",
    "checkpoint.save_final=false",
    "trainer.max_steps=3",
    "trainer.device=cpu",
]
# The default run's shape (conf/config.yaml) on the tiny model: its random weights never solve arithmetic,
# so math_verifier would leave every row out of the update; target_char gives every group a spread.
TINY_DEFAULT = ["model=tiny", "reward=target_char"]
# scripts/bench_vs_trl.py's sizes (tiny, smollm2), on the arithmetic prompts instead of its jsonl copy.
BENCH = ["std_correction=sample", "grpo.advantage_eps=1e-4", "model.gradient_checkpointing=true"]
SETTINGS = {
    "tiny-default": TINY_DEFAULT,
    "tiny-bench": [
        *TINY_DEFAULT,
        *BENCH,
        "grpo.group_size=8",
        "generation.max_new_tokens=32",
        "trainer.prompts_per_step=4",
        "trainer.micro_batch_size=8",
        "trainer.lr=1e-5",
    ],
    "tiny-beta": [*TINY_DEFAULT, "grpo.beta=0.04"],
    "smollm2-default": ["model=smollm2-135m"],
    "smollm2-bench": [
        "model=smollm2-135m",
        *BENCH,
        "grpo.group_size=4",
        "generation.max_new_tokens=64",
        "trainer.prompts_per_step=2",
        "trainer.micro_batch_size=8",
        "trainer.lr=1e-5",
    ],
    "smollm2-beta": ["model=smollm2-135m", "grpo.beta=0.04"],
}


def rss_kib(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))


def reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")


def typed_config(overrides: list[str], run_dir: Path):
    from hydra import compose, initialize_config_dir
    from omegaconf import open_dict

    from grpo_run.cli import CONF_DIR
    from grpo_run.config import to_config

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        raw = compose(config_name="config", overrides=overrides)
    with open_dict(raw):
        raw.run_dir = str(run_dir)
    return to_config(raw)


def measure(overrides: list[str], run_dir: Path) -> dict:
    """Run in this process; {phase: peak resident MiB above the baseline}, the max over the steps."""
    import grpo_run.rollout.groups as groups
    import grpo_run.trainer as trainer
    import grpo_run.update as update

    cfg = typed_config(overrides, run_dir)
    peaks: dict[str, float] = {}

    def phase(name, fn):
        def wrapped(*args, **kwargs):
            reset_peak()
            try:
                return fn(*args, **kwargs)
            finally:
                mib = (rss_kib("VmHWM") - baseline) / 1024
                peaks[name] = max(peaks.get(name, 0.0), mib)

        return wrapped

    groups.generate = phase("generation", groups.generate)
    update.old_and_reference_logprobs = phase("reference", update.old_and_reference_logprobs)
    trainer.policy_update = phase("update", trainer.policy_update)
    baseline = rss_kib("VmRSS")
    trainer.train(cfg)
    return {"baseline_mib": baseline / 1024, **{f"{k}_mib": v for k, v in peaks.items()}}


def estimate(overrides: list[str]) -> dict:
    """mode=plan's own estimate of the same config (in process: nothing loads)."""
    from grpo_run.plan import build_plan

    with tempfile.TemporaryDirectory() as tmp:
        plan = build_plan(typed_config(overrides, Path(tmp)))
    return {f"est_{k}_mib": v / 2**20 for k, v in plan["memory"]["phases"].items()}


def main() -> None:
    """Measure the settings named (all by default) that have no measurement yet (--remeasure: again)."""
    args = sys.argv[1:]
    remeasure = "--remeasure" in args
    names = [a for a in args if not a.startswith("--")] or list(SETTINGS)
    out = REPO / "outputs" / "plan_calibration"
    out.mkdir(parents=True, exist_ok=True)
    if os.environ.get("_PLAN_CAL_CHILD"):
        name = names[0]
        with tempfile.TemporaryDirectory() as tmp:
            result = measure([*SETTINGS[name], *QUIET], Path(tmp) / "run")
        (out / f"{name}.json").write_text(json.dumps(result, indent=2))
        return
    rows = []
    for name in names:
        path = out / f"{name}.json"
        if remeasure or not path.exists():
            env = {**os.environ, "_PLAN_CAL_CHILD": "1", "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
            subprocess.run([sys.executable, __file__, name], cwd=REPO, env=env, check=True)
        measured = {k: v for k, v in json.loads(path.read_text()).items() if not k.startswith("est_")}
        row = {"setting": name, **measured, **estimate([*SETTINGS[name], *QUIET])}
        path.write_text(json.dumps(row, indent=2))
        rows.append(row)
    print(
        "| setting | baseline MiB | measured peak above it: generation / update MiB | estimated: generation / update MiB | update error |"
    )
    print("|---|---|---|---|---|")
    for r in rows:
        measured, est = r["update_mib"], r["est_update_mib"]
        print(
            f"| {r['setting']} | {r['baseline_mib']:.0f} | {r['generation_mib']:.0f} / {measured:.0f} | "
            f"{r['est_generation_mib']:.0f} / {est:.0f} | {(est - measured) / measured:+.0%} |"
        )


if __name__ == "__main__":
    main()
