"""The batch arithmetic of a run, the data's prompt lengths, and the changes that make a plan fit."""

import re
import statistics
from dataclasses import dataclass

from grpo_run.config.schema import Config
from grpo_run.plan.memory import MemoryInputs, estimate, with_changes


def batch_arithmetic(cfg: Config, prompt_len: int) -> dict[str, int]:
    """Prompts and completions per step and per rank, micro-batches, optimizer steps, tokens at max length."""
    t, g, d = cfg.trainer, cfg.grpo, cfg.distributed
    world = d.nproc_per_node * d.nnodes
    completions = t.prompts_per_step * g.group_size
    per_rank = completions // world
    length = prompt_len + cfg.generation.max_new_tokens
    return {
        "prompts_per_step": t.prompts_per_step,
        "group_size": g.group_size,
        "completions_per_step": completions,
        "world_size": world,
        "prompts_per_rank": t.prompts_per_step // world,
        "completions_per_rank": per_rank,
        "micro_batch_size": t.micro_batch_size,
        "micro_batches_per_optimizer_step": per_rank // t.micro_batch_size,
        "optimizer_steps_per_rollout": g.num_iterations,
        "optimizer_steps_per_run": t.max_steps * g.num_iterations,
        "max_generation_rounds": g.max_resample_rounds if g.filter_zero_std else 1,
        "prompt_tokens_max": prompt_len,
        "max_new_tokens": cfg.generation.max_new_tokens,
        "tokens_per_step_at_max_length": completions * length,
        "completion_tokens_per_step_at_max": completions * cfg.generation.max_new_tokens,
        "prompts_per_run": t.max_steps * t.prompts_per_step,
    }


def divisibility(cfg: Config) -> list[str]:
    """What divides what (validation has already refused a config where one does not)."""
    t, g, d = cfg.trainer, cfg.grpo, cfg.distributed
    world = d.nproc_per_node * d.nnodes
    per_rank = t.prompts_per_step * g.group_size // world
    return [
        f"trainer.prompts_per_step={t.prompts_per_step} divides by world size {world} (whole groups per rank)",
        f"{per_rank} completions per rank divide by trainer.micro_batch_size={t.micro_batch_size}",
    ]


def percentile(values: list[int], q: float) -> int:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def length_stats(values: list[int]) -> dict[str, float]:
    if not values:
        return {}
    return {
        "n": len(values),
        "min": min(values),
        "median": statistics.median(values),
        "p95": percentile(values, 0.95),
        "max": max(values),
    }


@dataclass(frozen=True)
class Change:
    """One way to make a plan smaller: the overrides a user types and the estimate's inputs it changes."""

    overrides: str
    why: str  # what it costs
    changes: dict


def smaller_micro_batches(x: MemoryInputs) -> list[Change]:
    """Each halving of the micro-batch that still divides the rows per rank, largest first."""
    out: list[Change] = []
    mb = x.micro_batch // 2
    while mb >= 1:
        if x.rows % mb == 0:
            out.append(
                Change(
                    f"trainer.micro_batch_size={mb}",
                    "more, smaller forward passes; same gradients",
                    {"micro_batch": mb},
                )
            )
        mb //= 2
    return out


def more_ranks(cfg: Config, x: MemoryInputs) -> list[Change]:
    """ZeRO-2 over each larger power-of-two world that divides the prompts per step, fewest ranks first;
    the micro-batch shrinks to the largest that divides the fewer rows per rank."""
    out: list[Change] = []
    b = cfg.trainer.prompts_per_step
    for world in (2, 4, 8, 16, 32, 64):
        if world <= x.world or b % world:
            continue
        rows = b * x.group_size // world
        mb = min(x.micro_batch, rows)
        while rows % mb:
            mb -= 1
        stage = max(x.zero_stage, 2)
        out.append(
            Change(
                f"distributed=zero2 distributed.nproc_per_node={world}"
                + (f" trainer.micro_batch_size={mb}" if mb != x.micro_batch else ""),
                f"{world} ranks (ZeRO-2 shards gradients and optimizer state)",
                {"world": world, "zero_stage": stage, "rows": rows, "micro_batch": mb},
            )
        )
    return out


def candidate_changes(cfg: Config, x: MemoryInputs) -> list[Change]:
    """Cheapest first: ones that leave the algorithm unchanged, then ones that change what is trained."""
    out = smaller_micro_batches(x)
    if not x.gradient_checkpointing:
        out.append(
            Change(
                "model.gradient_checkpointing=true",
                "recomputes each layer in the backward (~1/3 more update compute); same gradients",
                {"gradient_checkpointing": True},
            )
        )
    if not x.fused_head and x.native_forward:
        out.append(
            Change(
                "backend.fused_lm_head=true",
                "no [n, T, V] logits (needs grpo.entropy_coef=0)",
                {"fused_head": True},
            )
        )
    out += more_ranks(cfg, x)
    if not x.offload_optimizer:
        stage = max(x.zero_stage, 2)
        out.append(
            Change(
                f"distributed=zero2_offload distributed.nproc_per_node={x.world}",
                "optimizer state and step in host RAM (slower steps)",
                {"offload_optimizer": True, "zero_stage": stage},
            )
        )
    if not x.lora_rank:
        targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
        out.append(
            Change(
                "lora.r=16",
                "trains a rank-16 adapter instead of every weight (no reference copy)",
                {"lora_rank": 16, "lora_targets": targets},
            )
        )
    return out


def suggestions(cfg: Config, x: MemoryInputs, budget: int) -> list[dict]:
    """Each candidate with its new peak; those that fit alone first (cheapest first), else the
    cumulative combination in the same order until one fits."""
    rows = []
    for c in candidate_changes(cfg, x):
        peak = estimate(with_changes(x, **c.changes)).peak
        rows.append({"overrides": c.overrides, "why": c.why, "peak_bytes": peak, "fits": peak <= budget})
    fitting = [r for r in rows if r["fits"]]
    if fitting:
        return fitting[:4]
    # None fits alone: the smallest micro-batch, then each further change in order, until one fits.
    candidates = candidate_changes(cfg, x)
    smallest = [c for c in candidates if set(c.changes) == {"micro_batch"}][-1:]
    combined, applied = x, []
    for c in smallest + [c for c in candidates if set(c.changes) != {"micro_batch"}]:
        changes = dict(c.changes)
        if "world" in changes:  # more ranks replace fewer; the micro-batch stays the smallest so far
            applied = [a for a in applied if "nproc_per_node" not in a]
            changes["micro_batch"] = min(changes["micro_batch"], combined.micro_batch)
        combined = with_changes(combined, **changes)
        applied.append(re.sub(r"\s*trainer\.micro_batch_size=\d+", "", c.overrides))
        peak = estimate(combined).peak
        if peak <= budget:
            mb = (
                [f"trainer.micro_batch_size={combined.micro_batch}"]
                if combined.micro_batch != x.micro_batch
                else []
            )
            overrides = " ".join(mb + [a for a in applied if a])
            return [{"overrides": overrides, "why": "combined", "peak_bytes": peak, "fits": True}]
    return sorted(rows, key=lambda r: r["peak_bytes"])[:4]
