"""Run the real `grpo-run` command in a subprocess and read what it wrote."""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GRPO_RUN = str(Path(sys.executable).parent / "grpo-run")
# Small, fast settings for the tiny model; tests add their own overrides after these.
FAST = [
    "model=tiny",
    "reward=target_char",
    "trainer.max_steps=2",
    "trainer.prompts_per_step=2",
    "grpo.group_size=4",
    "trainer.micro_batch_size=4",
    "generation.max_new_tokens=8",
    "trainer.device=cpu",
    "eval.every_steps=0",  # the default config evaluates SmolLM2 on 200 held-out problems
    "trainer.lr_scheduler=constant",  # the default run decays its lr over its own 32 steps
    # Console and metrics.jsonl only: the W&B client starts a service process per run (seconds of each
    # short run); the tests of logger=wandb ask for it (tests/integration/test_wandb.py and others).
    "logger=console",
]


def adamw_tolerance(lr: float, steps: int) -> float:
    """How far two runs' weights may drift apart when their gradients differ only by float rounding (sums
    in another order: ZeRO-2's reduce-scatter, another CPU's kernels).

    AdamW moves a weight by up to about lr per step whatever the gradient's size, so a rounding-level
    change of a near-zero gradient can move that weight's update by a sizeable share of lr; a weight's
    whole travel is bounded by lr x steps. 0.5% of that travel is far below what a real divergence gives
    (a missed all-reduce moves weights by the order of lr at the first step) and far above rounding.
    """
    return 5e-3 * lr * steps


def run_cli(args: list[str], tmp_path: Path, *, timeout: float = 300, check: bool = True, env=None):
    """`grpo-run ARGS hydra.run.dir=tmp_path/run` → (CompletedProcess, run dir)."""
    run_dir = tmp_path / "run"
    extra = (
        [] if any(a.startswith(("hydra.run.dir", "-m", "--")) for a in args) else [f"hydra.run.dir={run_dir}"]
    )
    proc = subprocess.run(
        [GRPO_RUN, *args, *extra],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"grpo-run failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc, run_dir


def read_metrics(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def stand_in(monkeypatch, name: str, fn) -> None:
    """Replace the built-in reward `name`'s function for one test; its record (isolation, range) stays."""
    from dataclasses import replace

    from grpo_run.scoring.registry import BUILTIN_REWARDS

    monkeypatch.setitem(BUILTIN_REWARDS, name, replace(BUILTIN_REWARDS[name], fn=fn))
