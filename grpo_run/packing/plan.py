"""Which rows go in which packed micro-batch: a balanced first-fit by estimated cost.

A micro-batch's cost is counted in token-equivalents: every token once (the projections and the MLP,
linear in length) plus attention's quadratic term, `weight` per (query, key) pair (`attention_weight`).
A padded micro-batch pays for its longest row on every row; a packed one pays for its real tokens only,
so a budget of tokens rather than a count of rows makes micro-batches of even cost whatever the spread
of lengths.
"""

import math
from typing import NamedTuple

import torch


def attention_weight(config) -> float:
    """Attention's cost of one (query, key) pair against one token's linear cost, from a model config:
    QKᵀ and the weighted sum of V take 4·heads·head_dim flops per pair; a token's projections and MLP take
    2 flops per weight of a layer. (About 3e-4 for SmolLM2-135M: the quadratic term matters from
    sequences of a few thousand tokens on.)"""
    hidden = config.hidden_size
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    inter = getattr(config, "intermediate_size", None) or 4 * hidden
    layer_weights = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim + 3 * hidden * inter
    return 4 * heads * head_dim / (2 * layer_weights)


class Unit(NamedTuple):
    """Rows that go into a micro-batch together (a prompt's rows when prompts are shared), and their cost."""

    rows: list[int]
    cost: float


def sequence_cost(length: float, weight: float, prefix: float = 0.0) -> float:
    """`length` tokens under causal attention after `prefix` keys they all see: each token once, plus
    `weight` per (query, key) pair (length · (prefix + (length + 1) / 2) pairs)."""
    return length + weight * length * (prefix + (length + 1) / 2)


def row_units(
    prompt_mask: torch.Tensor,
    completion_mask: torch.Tensor,
    *,
    weight: float,
    budget: float,
    prompt_keys: list[int] | None = None,
) -> list[Unit]:
    """The units the planner places: each row alone (prompt and completion one sequence), or with
    `prompt_keys` (each row's prompt among the distinct ones: the shared-prompt forward) the rows of one
    prompt together, the prompt paid once and its completions after it, split where a prompt's rows
    exceed `budget` (each part pays for the prompt again)."""
    p_len = prompt_mask.sum(1).tolist()
    c_len = completion_mask.sum(1).tolist()
    if prompt_keys is None:
        return [Unit([r], sequence_cost(p_len[r] + c_len[r], weight)) for r in range(len(p_len))]
    groups: dict[int, list[int]] = {}
    for r, key in enumerate(prompt_keys):
        groups.setdefault(key, []).append(r)
    units = []
    for rows in groups.values():
        p = p_len[rows[0]]
        base = sequence_cost(p, weight)
        part, cost = [], base
        for r in rows:
            extra = sequence_cost(c_len[r], weight, prefix=p)
            if part and cost + extra > budget:
                units.append(Unit(part, cost))
                part, cost = [], base
            part.append(r)
            cost += extra
        units.append(Unit(part, cost))
    return units


def plan_micro_batches(units: list[Unit], budget: float) -> list[list[int]]:
    """Units → micro-batches (sorted row lists, in order of their first row), each of cost at most
    `budget`: as many micro-batches as the total cost needs, then the units by decreasing cost, each into
    the least loaded micro-batch it fits in (a new one when none has room). A unit over the budget gets a
    micro-batch of its own, never dropped."""
    total = sum(u.cost for u in units)
    loads = [0.0] * max(1, math.ceil(total / budget))
    members: list[list[int]] = [[] for _ in loads]
    for unit in sorted(units, key=lambda u: -u.cost):
        if unit.cost > budget:
            loads.append(math.inf)  # alone, and closed to others
            members.append(list(unit.rows))
            continue
        fits = [b for b, load in enumerate(loads) if load + unit.cost <= budget]
        if not fits:
            loads.append(0.0)
            members.append([])
            fits = [len(loads) - 1]
        b = min(fits, key=lambda i: loads[i])
        loads[b] += unit.cost
        members[b].extend(unit.rows)
    return sorted((sorted(m) for m in members if m), key=lambda m: m[0])
