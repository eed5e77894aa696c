"""The update's arithmetic rate against this machine's bf16 matmul rate, measured side by side.

Issue 7 asks for the update at >= 60% of the bf16 matmul rate, counting 6 * params * tokens FLOPs. Both
rates move with the machine's load from minute to minute, so this script alternates them in one process
(one thread by default, as the benchmark against TRL runs): each round times a 2048^3 bf16 matmul, then
one update of SmolLM2-135M per variant, at the default run's shape (8 prompts x 8 completions, 50 + 32
tokens, micro-batches of 16): log-probs forward + backward per micro-batch, gradient clipping and the
fused AdamW step, the calls the trainer makes (bf16 autocast, gradient checkpointing). Variants, each
without one more of the defaults: the default path (shared-prompt forward, weights cast once per
update, the LM head fused into the chunked log-softmax), logits first, without the once-per-update casts
either, and without the shared-prompt forward too (every row runs its own prompt, autocast casts at
every use).

    python scripts/bench_update_rate.py                      # default-run shape, 4 rounds
    python scripts/bench_update_rate.py --completion-len 128 --prompts 4 --micro-batch 16  # reference
"""

import argparse
import os
import resource
import statistics
import sys
import time
from functools import partial
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


VARIANTS = {  # name -> (shared-prompt forward, weights cast once per update, fused LM head)
    "default": (True, True, True),
    "logits-first": (True, True, False),
    "no-cast-once": (True, False, False),
    "neither": (False, False, False),
}


def matmul_rate(size: int = 2048, reps: int = 5) -> float:
    """GFLOP/s of a size^3 bf16 matmul (best of reps, after a warm-up)."""
    import torch

    a = torch.randn(size, size).to(torch.bfloat16)
    b = torch.randn(size, size).to(torch.bfloat16)
    a @ b
    best = min(_timed(lambda: a @ b) for _ in range(reps))
    return 2 * size**3 / best / 1e9


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--prompts", type=int, default=8, help="distinct prompts in the step (B)")
    p.add_argument("--group-size", type=int, default=8, help="G")
    p.add_argument("--prompt-len", type=int, default=50)
    p.add_argument("--completion-len", type=int, default=32)
    p.add_argument("--micro-batch", type=int, default=16)
    p.add_argument("--variants", nargs="+", choices=sorted(VARIANTS), default=list(VARIANTS))
    a = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(a.threads))
    from grpo_run.native.heap import prepare_process

    prepare_process()  # the allocator settings of a grpo-run process, before torch loads

    import torch
    from transformers import AutoModelForCausalLM

    from grpo_run.models.forward import completion_logprobs
    from grpo_run.models.loading import enable_checkpointing
    from grpo_run.models.smollm2 import ensure_smollm2
    from grpo_run.native.weight_casts import WeightCasts

    torch.set_num_threads(a.threads)
    cache = Path(os.environ.get("GRPO_RUN_CACHE", Path.home() / ".cache" / "grpo-run"))
    path = ensure_smollm2(cache)
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").train()
    enable_checkpointing(model)  # as conf/model/smollm2-135m.yaml
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-9, fused=True)
    params = sum(p.numel() for p in model.parameters())

    g = torch.Generator().manual_seed(0)
    vocab, n = model.config.vocab_size, a.prompts * a.group_size
    prompts = torch.randint(3, vocab, (a.prompts, a.prompt_len), generator=g).repeat_interleave(
        a.group_size, 0
    )
    completions = torch.randint(3, vocab, (n, a.completion_len), generator=g)
    flops = 6 * params * n * (a.prompt_len + a.completion_len)

    def update(share: bool, cast_once: bool, fused_head: bool) -> None:
        casts = WeightCasts() if cast_once else None
        for start in range(0, n, a.micro_batch):
            mb = slice(start, start + a.micro_batch)
            if casts is not None and start + a.micro_batch >= n:
                casts.release_on_use()  # as trainer.update: the last forward keeps no cast
            with torch.autocast("cpu", dtype=torch.bfloat16):
                lp, _ = completion_logprobs(
                    model,
                    prompts[mb],
                    torch.ones_like(prompts[mb]),
                    completions[mb],
                    temperature=1.0,
                    chunk_size=256,
                    with_entropy=True,
                    share_prompts=share,
                    weight_casts=casts,
                    fused_head=fused_head,
                )
            (lp.sum() / n).backward()
        del casts
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    variants = {name: VARIANTS[name] for name in a.variants}
    for flags in variants.values():
        update(*flags)  # warm-up
    print(
        f"SmolLM2-135M ({params / 1e6:.1f}M parameters), {n} completions = {a.prompts} prompts x {a.group_size},"
        f" {a.prompt_len} + {a.completion_len} tokens, micro-batch {a.micro_batch}, {a.threads} thread(s);"
        f" {flops / 1e12:.2f} TFLOP counted (6 * params * tokens) per update"
    )
    ratios: dict[str, list[float]] = {name: [] for name in variants}
    for r in range(a.rounds):
        peak = matmul_rate()
        line = [f"round {r + 1}: matmul {peak:.0f} GFLOP/s"]
        for name, flags in variants.items():
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            seconds = _timed(partial(update, *flags))
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
            rate = flops / seconds / 1e9
            ratios[name].append(rate / peak)
            line.append(
                f"{name} {seconds:.2f} s = {rate:.0f} GFLOP/s ({100 * rate / peak:.0f}%, {faults / 1e3:.0f}k page faults)"
            )
        print(", ".join(line), flush=True)
    print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GB")
    for name, values in ratios.items():
        print(
            f"{name}: median {100 * statistics.median(values):.0f}% of the matmul rate"
            f" (min {100 * min(values):.0f}%, max {100 * max(values):.0f}%)"
        )


if __name__ == "__main__":
    main()
