"""The planner: every row in exactly one micro-batch, each within the budget (an over-budget row alone),
costs counted with attention's quadratic term, a shared prompt paid once per micro-batch."""

import pytest
import torch
from transformers import LlamaConfig

from grpo_run.packing import attention_weight, plan_micro_batches, row_units
from grpo_run.packing.plan import Unit, sequence_cost


def masks(prompts: list[int], completions: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompt masks and completion masks of the given lengths."""
    p, t = max(prompts), max(completions)
    pm = torch.tensor([[0] * (p - n) + [1] * n for n in prompts])
    cm = torch.tensor([[1] * n + [0] * (t - n) for n in completions])
    return pm, cm


def test_sequence_cost_counts_each_token_and_each_causal_pair():
    # 4 tokens: 4 + w * (1 + 2 + 3 + 4) pairs = 4 + 10w; after a prefix of 3 keys: 4 + w * (12 + 10).
    assert sequence_cost(4, 0.5) == 4 + 0.5 * 10
    assert sequence_cost(4, 0.5, prefix=3) == 4 + 0.5 * 22
    assert sequence_cost(4, 0.0) == 4


def test_attention_weight_of_smollm2_shape():
    # SmolLM2-135M: hidden 576, 9 heads of 64, 3 kv heads, MLP 1536. Per (query, key) pair 4 * 576 flops;
    # per token 2 * (2 * 576 * 576 + 2 * 576 * 192 + 3 * 576 * 1536) = 7,077,888.
    cfg = LlamaConfig(
        hidden_size=576, num_attention_heads=9, num_key_value_heads=3, intermediate_size=1536, vocab_size=8
    )
    assert attention_weight(cfg) == pytest.approx(4 * 576 / 7_077_888)


def test_the_worked_plan_balances_by_cost_not_row_count():
    # Costs 9, 7, 5, 3, 2, 1 (total 27) in a budget of 10: ceil(27 / 10) = 3 micro-batches; by decreasing
    # cost into the least loaded that fits: 9 -> A, 7 -> B, 5 -> C, 3 -> C (8), 2 -> B (9), 1 -> C (9):
    # loads 9, 9, 9 (a first fit in order would give 9+1, 7+3, 5+2: 10, 10, 7).
    units = [Unit([r], c) for r, c in enumerate([9, 7, 5, 3, 2, 1])]
    assert plan_micro_batches(units, 10) == [[0], [1, 4], [2, 3, 5]]


def test_an_over_budget_row_gets_a_micro_batch_of_its_own_and_nothing_is_dropped():
    units = [Unit([0], 3), Unit([1], 50), Unit([2], 4), Unit([3], 2)]
    plans = plan_micro_batches(units, 10)
    assert [1] in plans
    assert sorted(r for p in plans for r in p) == [0, 1, 2, 3]


@pytest.mark.parametrize("budget", [1, 40, 300, 10_000])
def test_every_row_once_and_every_micro_batch_within_budget(budget):
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(1, 30, (24,), generator=g).tolist()
    completions = torch.randint(0, 60, (24,), generator=g).tolist()
    pm, cm = masks(prompts, completions)
    units = row_units(pm, cm, weight=1e-3, budget=budget)
    plans = plan_micro_batches(units, budget)
    assert sorted(r for p in plans for r in p) == list(range(24))
    cost = {u.rows[0]: u.cost for u in units}
    for p in plans:
        assert len(p) == 1 or sum(cost[r] for r in p) <= budget


def test_shared_prompt_units_pay_the_prompt_once_and_split_over_budget():
    # Rows 0-2 share a 10-token prompt, row 3 has its own; completions 5, 5, 5, 2 tokens; weight 0.
    pm, cm = masks([10, 10, 10, 4], [5, 5, 5, 2])
    units = row_units(pm, cm, weight=0.0, budget=100, prompt_keys=[0, 0, 0, 1])
    assert sorted((u.rows, u.cost) for u in units) == [([0, 1, 2], 10 + 15), ([3], 4 + 2)]
    # A budget of 20: the prompt (10) and one completion (5) fit, a second would make 20, a third 25.
    split = row_units(pm, cm, weight=0.0, budget=20, prompt_keys=[0, 0, 0, 1])
    assert sorted(u.rows for u in split) == [[0, 1], [2], [3]]
