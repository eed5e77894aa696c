"""Packed against padded micro-batches (`trainer.padding_free`): the update alone on SmolLM2-135M.

The update of one step (`update.training_batch` + `update.policy_update`: forward, backward and the AdamW
step, the trainer's own calls) on B = 8 prompts x G = 8 completions with a fixed length profile:
`spread` is verl's Qwen2.5-0.5B GSM8K profile scaled to a CPU (prompts of 60-120 tokens, responses
capped at 256, 43% at the cap, mean near 150), `uniform` the control (every prompt 90 tokens, every
response 150: nothing to pad). float32, the default run's settings otherwise (gradient checkpointing,
eager attention, shared-prompt forward, fused LM head, micro-batches of 16). Each side runs in a process
of its own with one thread, packed and padded alternating (their order swapped every round), each
process one warm-up update on the first two groups (its gradients compared across the sides: the same
weights, the same rows; the packed side's first-step check runs in it) and `--updates` timed ones. Reports seconds per update, tokens/s (real tokens: prompts + completions),
the padding fraction of the padded side's micro-batches, peak RSS; the last line is
`padding_free speedup <x> on <profile>` (median seconds padded / packed, the spread profile's).

    python scripts/bench_packing.py --rounds 1              # both profiles (~15 min on a quiet core)
    python scripts/bench_packing.py --rounds 2 --prompts 2  # a short check (B = 2: one padded micro-batch)
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

PROFILES = ("spread", "uniform")


def lengths(profile: str, prompts: int, group: int) -> tuple[list[int], list[int]]:
    """(prompt length per prompt [B], response length per row [B*G]), fixed by a seed. spread: prompts
    uniform in 60..120; 43% of responses at the cap of 256, the rest uniform in 8..132 (mean 70), so the
    mean is 0.43 * 256 + 0.57 * 70 = 150."""
    import torch

    if profile == "uniform":
        return [90] * prompts, [150] * (prompts * group)
    g = torch.Generator().manual_seed(68)
    n = prompts * group
    prompt_lens = torch.randint(60, 121, (prompts,), generator=g).tolist()
    at_cap = torch.randperm(n, generator=g)[: round(0.43 * n)]
    responses = torch.randint(8, 133, (n,), generator=g)
    responses[at_cap] = 256
    return prompt_lens, responses.tolist()


def rollout_of(profile: str, prompts: int, group: int, vocab: int, eos: int, pad: int):
    """The step's Rollout and rewards [B, G] (every group mixed: no row is left out of the update)."""
    import torch

    from grpo_run.rollout.generate import Rollout

    prompt_lens, responses = lengths(profile, prompts, group)
    g = torch.Generator().manual_seed(1)
    p_width, t_width = max(prompt_lens), 256 if profile == "spread" else 150
    prompt_ids = torch.full((prompts, p_width), pad)
    prompt_mask = torch.zeros(prompts, p_width, dtype=torch.long)
    for b, n in enumerate(prompt_lens):
        prompt_ids[b, p_width - n :] = torch.randint(3, vocab, (n,), generator=g)
        prompt_mask[b, p_width - n :] = 1
    n = prompts * group
    completion_ids = torch.full((n, t_width), pad)
    completion_mask = torch.zeros(n, t_width, dtype=torch.long)
    truncated = torch.zeros(n, dtype=torch.bool)
    for r, length in enumerate(responses):
        completion_ids[r, :length] = torch.randint(3, vocab, (length,), generator=g)
        completion_mask[r, :length] = 1
        if length < t_width or profile == "uniform":
            completion_ids[r, length - 1] = eos
        else:
            truncated[r] = True
    rollout = Rollout(
        prompt_ids=prompt_ids.repeat_interleave(group, 0),
        prompt_mask=prompt_mask.repeat_interleave(group, 0),
        completion_ids=completion_ids,
        completion_mask=completion_mask,
        truncated=truncated,
    )
    rewards = ((torch.arange(group)[None, :] + torch.arange(prompts)[:, None]) % 3 == 0).float()  # [B, G]
    return rollout, rewards


def side(a) -> None:
    """One process: load SmolLM2, run the warm-up and timed updates with trainer.padding_free=a.packed,
    print one JSON line."""
    from grpo_run.native.heap import prepare_process

    prepare_process()
    import torch

    from grpo_run import metrics as M
    from grpo_run import update
    from grpo_run.algo import compute_advantages
    from grpo_run.backend import training_forward
    from grpo_run.engine.build import single_engine
    from grpo_run.models.loading import load_model
    from grpo_run.rollout.filtering import loss_mask, take_rows
    from tests.builders import compose_config

    torch.set_num_threads(1)
    cpu = torch.device("cpu")
    cfg = compose_config(
        [
            "model.autocast_bf16=false",
            "trainer.device=cpu",
            f"trainer.padding_free={str(a.packed).lower()}",
            f"trainer.prompts_per_step={a.prompts}",
        ]
    )
    model = load_model(cfg.model, cpu, trainable=True).train()
    c = model.config
    rollout, rewards = rollout_of(a.profile, a.prompts, cfg.grpo.group_size, c.vocab_size, c.eos_token_id, 0)
    engine, forward = single_engine(cfg, model, cpu), training_forward(cfg, cpu)
    grad_norms: dict[str, float] = {}
    real_step = engine.step

    def step():  # the warm-up's gradients, per parameter, before the optimizer uses them
        if not grad_norms:
            grad_norms.update(
                {n: float(p.grad.norm()) for n, p in model.named_parameters() if p.grad is not None}
            )
        return real_step()

    engine.step = step

    settings = update.UpdateSettings.of(cfg)
    models = update.UpdateModels(engine, forward, model)
    coefs = update.StepCoefs(cfg.grpo.beta, cfg.grpo.entropy_coef)

    def one_update(rollout, rewards) -> float:
        g = cfg.grpo
        advantages = compute_advantages(rewards, g.advantage_mode, g.std_correction, g.advantage_eps).reshape(
            -1
        )
        mask = loss_mask(rollout, g.mask_truncated)
        t0 = time.perf_counter()
        inputs = update.StepInputs(rollout, advantages, mask)
        batch = update.training_batch(inputs, M.StepMetrics(cpu), settings, models, coefs)
        update.policy_update(batch, M.StepMetrics(cpu), settings, models, coefs)
        forward.release_memory()
        return time.perf_counter() - t0

    # The warm-up: the first two groups (one padded micro-batch of 16), the packed side's check included.
    group = cfg.grpo.group_size
    warm = one_update(take_rows(rollout, list(range(2 * group))), rewards[:2])
    seconds = [one_update(rollout, rewards) for _ in range(a.updates)]
    real = int(rollout.prompt_mask.sum() + rollout.completion_mask.sum())
    mb = cfg.trainer.micro_batch_size
    padded_positions = sum(
        (rollout.prompt_mask[i : i + mb].sum(1).max() + rollout.completion_mask[i : i + mb].sum(1).max()) * mb
        for i in range(0, rollout.completion_ids.size(0), mb)
    )
    state = forward.packing
    print(
        json.dumps(
            {
                "warm_s": warm,
                "seconds": seconds,
                "tokens": real,
                "padding": 1 - real / float(padded_positions),
                "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
                "grad_norms": grad_norms,
                "packed": state is not None and state.enabled,
                "check": None if state is None else state.largest_difference,
            }
        )
    )


def run_side(profile: str, packed: bool, a) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    args = [
        sys.executable,
        __file__,
        "--side",
        profile,
        "--prompts",
        str(a.prompts),
        "--updates",
        str(a.updates),
    ]
    out = subprocess.run([*args, *(["--packed"] if packed else [])], env=env, capture_output=True, text=True)
    if out.returncode:
        sys.exit(f"{profile} {'packed' if packed else 'padded'} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--updates", type=int, default=1, help="timed updates per process, after one warm-up")
    p.add_argument("--prompts", type=int, default=8, help="B (G = 8)")
    p.add_argument("--profiles", nargs="+", choices=PROFILES, default=list(PROFILES))
    p.add_argument("--side", choices=PROFILES, help=argparse.SUPPRESS)
    p.add_argument("--packed", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.side:
        a.profile = a.side
        return side(a)
    runs: dict[tuple[str, bool], list[dict]] = {}
    for r in range(a.rounds):
        for profile in a.profiles:
            order = (True, False) if r % 2 == 0 else (False, True)
            for packed in order:
                res = run_side(profile, packed, a)
                runs.setdefault((profile, packed), []).append(res)
                name = "packed" if packed else "padded"
                print(
                    f"round {r + 1} {profile} {name}: {statistics.median(res['seconds']):.2f} s/update "
                    f"(warm-up {res['warm_s']:.2f} s), peak RSS {res['peak_rss_gb']:.2f} GB",
                    flush=True,
                )
    speedups = {}
    for profile in a.profiles:
        packed, padded = runs[(profile, True)], runs[(profile, False)]
        s_packed = statistics.median(s for res in packed for s in res["seconds"])
        s_padded = statistics.median(s for res in padded for s in res["seconds"])
        tokens = packed[0]["tokens"]
        g_packed, g_padded = packed[0]["grad_norms"], padded[0]["grad_norms"]
        worst = max(abs(g_packed[k] - v) / max(v, 1e-12) for k, v in g_padded.items())
        speedups[profile] = s_padded / s_packed
        print(
            f"{profile}: {tokens} tokens, padding {100 * padded[0]['padding']:.0f}% of the padded micro-batches; "
            f"padded {s_padded:.2f} s/update ({tokens / s_padded:.0f} tokens/s, peak RSS "
            f"{max(x['peak_rss_gb'] for x in padded):.2f} GB), packed {s_packed:.2f} s/update "
            f"({tokens / s_packed:.0f} tokens/s, peak RSS {max(x['peak_rss_gb'] for x in packed):.2f} GB); "
            f"speedup {speedups[profile]:.2f}x; packed stayed on: {all(x['packed'] for x in packed)} (check "
            f"{packed[0]['check']:.2g}); per-parameter grad norms differ by at most {worst:.1e} (relative)"
        )
    for profile in [q for q in a.profiles if q != "spread"]:
        print(f"padding_free speedup {speedups[profile]:.2f} on {profile}")
    if "spread" in speedups:
        print(f"padding_free speedup {speedups['spread']:.2f} on spread")


if __name__ == "__main__":
    main()
