"""Generation throughput: grpo-run's native sampler against a colocated vLLM engine, alternating.

The default run's sampling path on each side: SmolLM2-135M-Instruct, float32 policy under bf16 autocast,
so the native sampler decodes from the bf16 sampling copy and vLLM runs a bf16 engine (as
generation=vllm builds it); temperature 0.7, EOS stopping on, arithmetic prompts in the chat template.
Each round times one generation per engine (the order alternates) and one vLLM weight sync (what every
optimizer step adds); the machine's load moves timings by +-20% from minute to minute, hence the
alternation in one process. Shapes: the default run's (8 prompts x 8 samples x 32 new tokens) and the
reference shape (4 x 8 x 128). Peak RSS is the whole process's (policy, sampling copy, engine, KV cache).

    python scripts/bench_generation.py                 # both shapes, 4 rounds each
    python scripts/bench_generation.py --rounds 2 --threads 2
"""

import argparse
import json
import os
import resource
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SHAPES = {"default": (8, 8, 32), "reference": (4, 8, 128)}


def rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "1")))
    ap.add_argument("--kv-gb", type=int, default=1)
    ap.add_argument("--out", default=str(REPO / "outputs" / "bench" / "generation.json"))
    args = ap.parse_args()

    import torch
    from hydra import compose, initialize_config_dir

    from grpo_run import backend
    from grpo_run.cli import CONF_DIR
    from grpo_run.config import register_configs, to_config
    from grpo_run.config.schema import GenerationEngineKind
    from grpo_run.data.prompts import chat_prompts
    from grpo_run.data.splits import load_data
    from grpo_run.models.loading import load_model, load_tokenizer
    from grpo_run.rollout.generate import SamplingParams, group_seed

    torch.set_num_threads(args.threads)
    register_configs()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        raw = compose(config_name="config", overrides=["generation=vllm", "logger=console", "run_dir=."])
    cfg = to_config(raw)
    d = cfg.data
    train, _ = load_data(d)
    tok = load_tokenizer(cfg.model)
    policy = load_model(cfg.model, torch.device("cpu"), trainable=True)
    local_cfg = replace(cfg, generation=replace(cfg.generation, engine=GenerationEngineKind.LOCAL))
    native_engine = backend.generation_engine(local_cfg, policy, tok)  # the default run's sampler
    rss_before = rss_gb()
    longest = max(s[2] for s in SHAPES.values())
    cfg.generation.max_new_tokens = longest
    cfg.generation.vllm.cpu_kvcache_space_gb = args.kv_gb
    t0 = time.perf_counter()
    prompts_all = chat_prompts(tok, d, [e.question for e in train[:64]])
    engine = backend.generation_engine(cfg, policy, tok, prompts=prompts_all)
    start_s = time.perf_counter() - t0
    print(f"vLLM engine started in {start_s:.1f} s (threads {torch.get_num_threads()})", flush=True)

    def native(ids, mask, g, params, seeds):
        native_engine.policy_updated()  # as after an optimizer step: the bf16 copy is rebuilt each time
        return native_engine.generate(ids, mask, group_size=g, params=params, seeds=seeds)

    def vllm(ids, mask, g, params, seeds):
        return engine.generate(ids, mask, group_size=g, params=params, seeds=seeds)

    results: dict = {"threads": args.threads, "engine_start_s": start_s, "shapes": {}}
    for name, (b, g, t) in SHAPES.items():
        params = SamplingParams(max_new_tokens=t, temperature=0.7)
        rows = {"native": [], "vllm": [], "sync_s": []}
        for r in range(args.rounds):
            questions = [e.question for e in train[r * b : (r + 1) * b]]
            enc = tok(
                chat_prompts(tok, d, questions), return_tensors="pt", padding=True, add_special_tokens=False
            )
            seeds = [group_seed(0, r + 1, i) for i in range(b)]
            order = [("native", native), ("vllm", vllm)]
            for label, fn in order if r % 2 == 0 else order[::-1]:
                t1 = time.perf_counter()
                out = fn(enc.input_ids, enc.attention_mask, g, params, seeds)
                dt = time.perf_counter() - t1
                rows[label].append(float(out.completion_mask.sum()) / dt)
            t1 = time.perf_counter()
            engine.sync()
            rows["sync_s"].append(time.perf_counter() - t1)
        engine.take_sync_seconds()
        summary = {k: statistics.median(v) for k, v in rows.items()}
        results["shapes"][name] = {"B x G x T": [b, g, t], "median": summary, "rounds": rows}
        print(
            f"{name:9s} {b}x{g}x{t}: native {summary['native']:.0f} tok/s, vLLM {summary['vllm']:.0f} tok/s, "
            f"sync {summary['sync_s']:.2f} s",
            flush=True,
        )
    results["peak_rss_gb"] = rss_gb()
    results["peak_rss_before_engine_gb"] = rss_before
    print(f"peak RSS {results['peak_rss_gb']:.2f} GB (before the engine started: {rss_before:.2f} GB)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    engine.close()
    native_engine.close()


if __name__ == "__main__":
    main()
