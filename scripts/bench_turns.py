"""Multi-turn sampling with the native decoder's cache continued (CachedTurns) against the history
prefilled again every turn (RePrefillTurns), alternating in one process on the same model, prompts,
seeds and environment.

The environment answers every model turn with the same short observation, so every episode runs
`--turns` model turns (or out of tokens) and the two samplers do the same work but for the prefill.
Each round times both; the script prints the seconds per call of `run_episodes` and checks that both
sampled the same tokens (float32: they should; bf16 autocast may differ by rounding).

    python scripts/bench_turns.py --size smollm2 --rounds 3
    python scripts/bench_turns.py --size tiny --rounds 5
"""

import argparse
import os
import time

import torch
from transformers import AutoModelForCausalLM

from grpo_run.config.schema import EnvConfig, ModelConfig, ModelKind
from grpo_run.data.arithmetic import generate_arithmetic
from grpo_run.data.example import Example
from grpo_run.envs.base import EnvResponse
from grpo_run.models.loading import load_tokenizer, resolve_model_path
from grpo_run.native.generation import NativeEngine
from grpo_run.rollout.episodes import ChatTurns, run_episodes
from grpo_run.rollout.generate import SamplingParams


class Answers:
    """Answers every model turn with one observation: every episode runs to max_turns."""

    def step(self, example, turns):
        return EnvResponse(observation="result: 42. Go on.", tool_called=True)


class NoCache:
    """The engine without `open_turns`: `open_turns` falls back to RePrefillTurns."""

    def __init__(self, engine):
        self.engine = engine

    def generate(self, *args, **kwargs):
        return self.engine.generate(*args, **kwargs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", choices=["tiny", "smollm2"], default="smollm2")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--max-new", type=int, default=48)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    kind = ModelKind.SMOLLM2 if args.size == "smollm2" else ModelKind.TINY
    cfg = ModelConfig(kind=kind, cache_dir=os.path.expanduser("~/.cache/grpo-run"))
    path = resolve_model_path(cfg)
    tok = load_tokenizer(cfg)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    engine = NativeEngine(
        model,
        eos_id=tok.eos_token_id,
        pad_id=tok.pad_token_id,
        autocast_bf16=False,
        decoder="native",
        bf16_sampling_copy=False,
    )
    problems = generate_arithmetic(args.prompts, seed=0, operations=["*"], min_digits=2, max_digits=3)
    texts = [
        tok.apply_chat_template(
            [{"role": "user", "content": p.question}], tokenize=False, add_generation_prompt=True
        )
        for p in problems
    ]
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    limits = EnvConfig(
        name="answers", max_turns=args.turns, max_total_tokens=args.turns * (args.max_new + 16)
    )
    chat = ChatTurns(tok, tok.eos_token_id)
    examples = [Example(p.question, p.answer, p.id) for p in problems]

    def run(e):
        t0 = time.perf_counter()
        out = run_episodes(
            e,
            Answers(),
            chat,
            examples,
            enc.input_ids,
            enc.attention_mask,
            group_size=args.group_size,
            params=SamplingParams(args.max_new, temperature=1.0),
            seeds=list(range(args.prompts)),
            limits=limits,
            eos_id=tok.eos_token_id,
            pad_id=tok.pad_token_id,
        )
        return time.perf_counter() - t0, out

    times = {"cached": [], "re-prefill": []}
    same = True
    for r in range(args.rounds):
        for name, e in (
            (("cached", engine), ("re-prefill", NoCache(engine)))
            if r % 2 == 0
            else (
                ("re-prefill", NoCache(engine)),
                ("cached", engine),
            )
        ):
            seconds, out = run(e)
            times[name].append(seconds)
            if name == "cached":
                cached_ids = [ep.ids for ep in out.episodes]
            else:
                fresh_ids = [ep.ids for ep in out.episodes]
        same &= cached_ids == fresh_ids
        turns = sum(ep.model_turns for ep in out.episodes) / len(out.episodes)
        tokens = sum(len(ep.ids) for ep in out.episodes) / len(out.episodes)
        print(
            f"round {r + 1}: cached {times['cached'][-1]:.2f} s, re-prefill {times['re-prefill'][-1]:.2f} s "
            f"(episodes {len(out.episodes)}, turns {turns:.2f}, tokens after the prompt {tokens:.0f}, "
            f"prompt columns {enc.input_ids.size(1)})"
        )
    for name, ts in times.items():
        print(f"{name}: {', '.join(f'{t:.2f}' for t in ts)} s; min {min(ts):.2f}")
    print(
        f"speed-up (min / min): {min(times['re-prefill']) / min(times['cached']):.2f}x; same tokens: {same}"
    )


if __name__ == "__main__":
    main()
