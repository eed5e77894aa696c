"""Does a refactor change behaviour? The same short runs at a base revision and at the checkout, compared.

Each setting runs `grpo-run` twice on one thread, once with the base revision's code (a git worktree in a
temporary folder, imported first through PYTHONPATH) and once with the checkout's, and compares every
logged metric except `perf/*` timings and the final weights, bit for bit (keys only the checkout logs are
metrics added since the base: listed, not compared):

    python scripts/same_behaviour.py --base 1ce1226                  # the tiny settings (~5 min)
    python scripts/same_behaviour.py --base 1ce1226 --smollm2        # and SmolLM2's default run, 3 steps
    python scripts/same_behaviour.py --base main --checkout-args trainer.padding_free=false  # packing off

The settings: the tiny model's defaults, beta = 0.04 with mu = 2, bf16 autocast with checkpointing, DAPO,
an evaluation, LoRA, and vLLM on a head-size-32 model (skipped without vLLM). `--smollm2` adds the default
run for 3 steps (float32 with --float32, for a CPU without bf16 instructions). Exit 1 when any differs.
"""

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[1]
RUN = "import sys; sys.argv = ['grpo-run', *sys.argv[1:]]; from grpo_run.cli import main; main()"
TINY = [
    "model=tiny",
    "reward=target_char",
    "trainer.prompts_per_step=2",
    "grpo.group_size=4",
    "trainer.micro_batch_size=4",
    "generation.max_new_tokens=8",
    "trainer.device=cpu",
    "eval.every_steps=0",
    "trainer.lr_scheduler=constant",
    "trainer.max_steps=3",
    "trainer.lr=3e-3",
]
QUIET = ["logger=console", "logger.console=false"]


def settings(scratch: Path, smollm2: bool, float32: bool) -> dict[str, list[str]]:
    out = {
        "default": TINY,
        "beta_mu2": [*TINY, "grpo.beta=0.04", "grpo.num_iterations=2"],
        "bf16_ckpt": [*TINY, "model.autocast_bf16=true", "model.gradient_checkpointing=true"],
        "dapo": ["experiment=dapo", *TINY],
        "eval": [*TINY, "eval.every_steps=3", "eval.num_prompts=8"],
        "lora": [*TINY, "lora=default"],
    }
    if importlib.util.find_spec("vllm") is not None:
        sys.path.insert(0, str(REPO))
        from tests.integration.test_vllm import write_tiny32

        write_tiny32(scratch / "tiny32")
        out["vllm"] = [
            *TINY,
            f"model.path={scratch / 'tiny32'}",
            "model.kind=pretrained",
            "model.dtype=float32",
            "generation=vllm",
            "generation.vllm.cpu_kvcache_space_gb=1",
            "grpo.num_iterations=2",
            "aggregation=per_token",
        ]
    if smollm2:
        out["smollm2"] = ["trainer.max_steps=3", "eval.every_steps=0"]
        if float32:
            out["smollm2"].append("model.autocast_bf16=false")
    return out


def run(tree: Path, args: list[str], run_dir: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-c", RUN, *args, *QUIET, f"hydra.run.dir={run_dir}"]
    proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{tree}: grpo-run {' '.join(args)} failed:\n{proc.stderr[-3000:]}")


def metrics(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    return [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in rows]


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    final = run_dir / "final"
    name = (
        "adapter_model.safetensors" if (final / "adapter_model.safetensors").exists() else "model.safetensors"
    )
    return load_file(final / name)


def new_keys(a: Path, b: Path) -> set[str]:
    """The metric keys the checkout's run `b` logs and the base's run `a` never does."""
    seen_a = {k for r in metrics(a) for k in r}
    return {k for r in metrics(b) for k in r} - seen_a


def compare(a: Path, b: Path) -> str | None:
    """None when both runs logged the same metrics and saved the same weights, else the first difference."""
    ma, mb = metrics(a), metrics(b)
    # Keys only the checkout logs are metrics added since the base (reported by `new_keys`, not a
    # difference); a key the checkout no longer logs is one.
    added = new_keys(a, b)
    mb = [{k: v for k, v in r.items() if k not in added} for r in mb]
    if ma != mb:
        for ra, rb in zip(ma, mb, strict=False):
            keys = sorted(k for k in set(ra) | set(rb) if ra.get(k) != rb.get(k))
            if keys:
                return f"step {ra.get('step')}: {', '.join(keys[:6])}"
        return f"{len(ma)} rows against {len(mb)}"
    wa, wb = weights(a), weights(b)
    if wa.keys() != wb.keys() or not all(torch.equal(wa[k], wb[k]) for k in wa):
        return "the final weights differ"
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="the revision to compare the checkout against")
    ap.add_argument("--smollm2", action="store_true", help="also SmolLM2's default run for 3 steps")
    ap.add_argument("--float32", action="store_true", help="SmolLM2 without bf16 autocast")
    ap.add_argument(
        "--checkout-args",
        nargs="*",
        default=[],
        help="overrides for the checkout's runs only, e.g. trainer.padding_free=false for a key the base lacks",
    )
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        base = scratch / "base"
        subprocess.run(
            ["git", "worktree", "add", "-q", "--detach", str(base), args.base], cwd=REPO, check=True
        )
        failed = False
        try:
            for name, overrides in settings(scratch, args.smollm2, args.float32).items():
                run(base, overrides, scratch / f"{name}.base")
                run(REPO, [*overrides, *args.checkout_args], scratch / f"{name}.checkout")
                diff = compare(scratch / f"{name}.base", scratch / f"{name}.checkout")
                failed |= diff is not None
                added = sorted(new_keys(scratch / f"{name}.base", scratch / f"{name}.checkout"))
                note = f" (new keys: {', '.join(added)})" if added and diff is None else ""
                print(f"{name}: {'identical' if diff is None else 'DIFFERS: ' + diff}{note}", flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=REPO, check=False)
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
