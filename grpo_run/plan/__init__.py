"""`grpo-run mode=plan`: the batch arithmetic, a memory estimate per device and a verdict, and the data's
prompt lengths, before anything is trained and without loading weights (docs/plan.md)."""

import json
from dataclasses import asdict
from pathlib import Path

from rich.table import Table

from grpo_run.config.schema import Config
from grpo_run.exit_codes import EXIT_DOES_NOT_FIT
from grpo_run.plan import inputs as I
from grpo_run.plan.arithmetic import batch_arithmetic, divisibility, length_stats, suggestions
from grpo_run.plan.memory import GB, estimate
from grpo_run.plan.presets import CHAT_TEMPLATE_TOKENS_BOUND
from grpo_run.tracking import console

PLAN_FILE = "plan.json"


def prompt_lengths(cfg: Config, tokenizer) -> tuple[dict, dict]:
    """Token counts of the first plan.num_records training prompts (chat-formatted as the run does) and
    of their reference answers. Without the tokenizer (None), upper bounds: UTF-8 bytes, plus the chat
    template's markup for a prompt (plan/presets.py)."""
    from grpo_run.data.prompts import chat_prompts, prompt_bytes
    from grpo_run.data.splits import evaluation_on, load_data

    train, _ = load_data(cfg.data, evaluate=evaluation_on(cfg))
    records = train[: cfg.plan.num_records]
    if tokenizer is None:
        lengths = [prompt_bytes(cfg.data, e) + CHAT_TEMPLATE_TOKENS_BOUND for e in records]
        return length_stats(lengths), length_stats([len(e.answer.encode()) for e in records])
    prompts = chat_prompts(tokenizer, cfg.data, records)
    lengths = [len(ids) for ids in tokenizer(prompts, add_special_tokens=False).input_ids]
    answers = [len(ids) for ids in tokenizer([e.answer for e in records], add_special_tokens=False).input_ids]
    return length_stats(lengths), length_stats(answers)


def length_warnings(cfg: Config, prompts: dict, answers: dict, max_positions: int) -> list[str]:
    out = []
    t = cfg.generation.max_new_tokens
    if max_positions and prompts and prompts["max"] + t > max_positions:
        out.append(
            f"the longest prompt ({prompts['max']} tokens) + generation.max_new_tokens={t} exceeds the model's "
            f"{max_positions} positions: shorten the prompts or lower generation.max_new_tokens"
        )
    if answers and answers["median"] >= t:
        out.append(
            f"most completions will likely be truncated: the data's reference answers have a median of "
            f"{answers['median']:g} tokens (p95 {answers['p95']}) >= generation.max_new_tokens={t}; raise it"
        )
    return out


def _gb(n: int | float) -> str:
    return f"{n / GB:.2f}"


def render(plan: dict) -> None:
    b = plan["batch"]
    table = Table(title="batch arithmetic", show_header=False)
    for key, value in b.items():
        table.add_row(key, str(value))
    for line in plan["divides"]:
        table.add_row("ok", line)
    console.print(table)
    mem = plan["memory"]
    table = Table(title=f"memory per device, GiB ({plan['device']['kind']})")
    table.add_column("term")
    for phase in mem["phases"]:
        table.add_column(phase, justify="right")
    for term, value in mem["components"].items():
        if value:
            table.add_row(term, *(_gb(value) if term in mem["phase_terms"][p] else "" for p in mem["phases"]))
    table.add_row("[bold]peak", *(f"[bold]{_gb(v)}" for v in mem["phases"].values()))
    console.print(table)
    if mem["host_bytes"]:
        console.print(f"host RAM (ZeRO-Offload optimizer state): {_gb(mem['host_bytes'])} GiB")
    v = plan["verdict"]
    dev = plan["device"]
    colour = "green" if v["fits"] else "red"
    console.print(
        f"[{colour}]{'fits' if v['fits'] else 'does not fit'}[/]: peak {_gb(mem['peak_bytes'])} GiB "
        f"({mem['peak_phase']}) vs {_gb(v['budget_bytes'])} GiB usable of {_gb(dev['bytes'])} GiB ({dev['source']})"
    )
    if v["suggestions"]:
        any_fits = any(s["fits"] for s in v["suggestions"])
        table = Table(title="changes that fit, cheapest first" if any_fits else "closest changes (none fits)")
        table.add_column("overrides", overflow="fold", ratio=3)
        table.add_column("new peak GiB", justify="right")
        table.add_column("fits")
        table.add_column("cost", overflow="fold", ratio=2)
        for s in v["suggestions"]:
            table.add_row(s["overrides"], _gb(s["peak_bytes"]), "yes" if s["fits"] else "no", s["why"])
        console.print(table)
    p = plan["prompts"]
    if p["prompt_tokens"]:
        table = Table(title=f"prompt lengths, tokens (first {p['prompt_tokens']['n']} records)")
        for col in ("", "min", "median", "p95", "max"):
            table.add_column(col)
        for name in ("prompt_tokens", "answer_tokens"):
            s = p[name]
            table.add_row(name, *(f"{s[k]:g}" for k in ("min", "median", "p95", "max")))
        table.add_row("model max positions", "", "", "", str(p["max_positions"]))
        table.add_row("generation.max_new_tokens", "", "", "", str(p["max_new_tokens"]))
        console.print(table)
    for line in plan["reward_models"]:
        console.print(f"reward model: {line}", soft_wrap=True, markup=False, highlight=False)
    for line in plan["distill"]:
        console.print(line, soft_wrap=True, markup=False, highlight=False)
    for w in plan["warnings"]:
        console.print(f"[yellow]warning: {w}")


def build_plan(cfg: Config) -> dict:
    loaded = I.load_plan_model(cfg)
    model_config = loaded.config
    dims = I.model_dims(model_config)
    prompts, answers = prompt_lengths(cfg, loaded.tokenizer)
    prompt_len = int(prompts["max"]) if prompts else 0
    device = I.resolve_device(cfg)
    native = I.native_forward_runs(cfg, model_config)
    reward_bytes, reward_lines = I.reward_models(cfg, device)
    x = I.memory_inputs(cfg, dims, native, prompt_len, device, reward_bytes)
    est = estimate(x)
    budget = I.usable_bytes(device)
    fits = est.peak <= budget
    warnings = loaded.notes + length_warnings(cfg, prompts, answers, dims.max_positions)
    if device.bytes == 0:
        warnings.append(device.source)
    inputs = asdict(x)
    inputs["dims"] = asdict(dims)
    return {
        "model": {
            "kind": cfg.model.kind.value,
            "path": cfg.model.path,
            "model_type": model_config.model_type,
        },
        "batch": batch_arithmetic(cfg, prompt_len),
        "divides": divisibility(cfg),
        "memory": {
            "inputs": inputs,
            "components": est.components,
            "phases": est.phases,
            "phase_terms": est.phase_terms,
            "peak_bytes": est.peak,
            "peak_phase": est.peak_phase,
            "host_bytes": est.host_bytes,
        },
        "device": asdict(device),
        "verdict": {
            "fits": fits,
            "budget_bytes": budget,
            "usable_fraction": I.USABLE_FRACTION,
            "suggestions": suggestions(cfg, x, budget) if not fits else [],
        },
        "prompts": {
            "prompt_tokens": prompts,
            "answer_tokens": answers,
            "max_positions": dims.max_positions,
            "max_new_tokens": cfg.generation.max_new_tokens,
        },
        "reward_models": reward_lines,
        "distill": I.distill_lines(cfg, est.components),
        "warnings": warnings,
    }


def plan(cfg: Config) -> int:
    """Print the plan, write plan.json in the run dir; 0 when it fits, EXIT_DOES_NOT_FIT otherwise."""
    result = build_plan(cfg)
    render(result)
    path = Path(cfg.run_dir) / PLAN_FILE
    path.write_text(json.dumps(result, indent=2, default=str))
    console.print(f"plan written to {path.resolve()}")
    return 0 if result["verdict"]["fits"] else EXIT_DOES_NOT_FIT
