"""Which rows each forward/backward pass runs: `micro_batches_for`, asked by the update and by every
no-gradient pass (π_old, π_ref, a teacher's, the asynchronous worker's). Slices of
`trainer.micro_batch_size` rows, padded; or with `trainer.padding_free` packed micro-batches by token
budget (`grpo_run/packing/`), checked on the run's first plan."""

import contextlib

import torch

from grpo_run.models.dropout import eval_mode
from grpo_run.models.forward import TrainingForward, trim_columns
from grpo_run.packing import PackingState, attention_weight, plan_micro_batches, row_units
from grpo_run.packing.check import largest_difference, off_line
from grpo_run.packing.pack import prompt_keys
from grpo_run.packing.plan import sequence_cost
from grpo_run.rollout.generate import Rollout
from grpo_run.tracking import console

# A micro-batch: a slice of rows, padded to its longest (trainer.padding_free off), or the row indices
# of a packed micro-batch (`micro_batches_for`).
MicroBatch = slice | torch.Tensor


def micro_batches(n: int, size: int) -> list[slice]:
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


def micro_batches_for(rollout: Rollout, forward: TrainingForward, model, size: int) -> list[MicroBatch]:
    """The micro-batches of a pass over `rollout`: slices of `size` rows, or with the forward's packing on
    (trainer.padding_free) the planner's rows by token budget (`packing.plan`). The run's first packed
    plan checks itself first (`check_packing`); a failed check leaves the run on slices from then on."""
    n = rollout.completion_ids.size(0)
    state = forward.packing
    if state is None or not state.enabled:
        return micro_batches(n, size)
    device = rollout.completion_ids.device
    plans = [
        torch.tensor(rows, dtype=torch.long, device=device)
        for rows in packed_plan(rollout, state, model, size)
    ]
    if not state.checked and not check_packing(forward, model, rollout, plans[0], state):
        return micro_batches(n, size)
    return plans


def packed_plan(rollout: Rollout, state: PackingState, model, size: int) -> list[list[int]]:
    """Rows → packed micro-batches by estimated cost: within `trainer.micro_batch_tokens`, or by default
    within `size` times the cost of the step's longest row (never more than the padded path's largest
    micro-batch holds)."""
    if state.weight is None:
        state.weight = attention_weight(model.config)
    p_mask, c_mask = rollout.prompt_mask, rollout.completion_mask
    longest = int((p_mask.sum(1) + c_mask.sum(1)).max())
    budget = state.budget or size * sequence_cost(longest, state.weight)
    keys = prompt_keys(rollout.prompt_ids, p_mask) if state.share_prompts else None
    units = row_units(p_mask, c_mask, weight=state.weight, budget=budget, prompt_keys=keys)
    return plan_micro_batches(units, budget)


def check_packing(forward: TrainingForward, model, rollout: Rollout, rows: torch.Tensor, state) -> bool:
    """One micro-batch's log-probs packed and padded, without gradient, in eval mode and in float32 where
    the weights are (`packing.check`); packing stays on when they agree within the tolerance, else one
    line says why it is off."""
    config = getattr(model, "config", None)
    flash = "flash" in str(getattr(config, "_attn_implementation", "") or "")
    in_float32 = next(model.parameters()).dtype == torch.float32 and not flash
    p_ids, p_mask, c_ids, c_mask = (
        rollout.prompt_ids[rows],
        rollout.prompt_mask[rows],
        rollout.completion_ids[rows],
        rollout.completion_mask[rows],
    )
    with torch.no_grad(), eval_mode(model), float32_pass(forward, in_float32):
        packed, _ = forward.packed_logprobs(model, p_ids, p_mask, c_ids, c_mask, with_entropy=False)
        padded, _ = forward.logprobs(
            model, *trim_columns(p_ids, p_mask, c_ids, c_mask)[:3], with_entropy=False
        )
    mask = rollout.completion_mask[rows, : padded.size(1)]
    difference = largest_difference(packed, padded, mask)
    dtype = torch.float32 if in_float32 else torch.bfloat16
    if not state.record_check(difference, dtype):
        name = getattr(model, "name_or_path", None) or type(model).__name__
        console.print(
            off_line(name, difference, dtype), style="yellow", soft_wrap=True, markup=False, highlight=False
        )
    return state.enabled


@contextlib.contextmanager
def float32_pass(forward: TrainingForward, on: bool):
    """The forward without its bf16 autocast inside the block (when `on`)."""
    was = forward.autocast_bf16
    forward.autocast_bf16 = was and not on
    try:
        yield
    finally:
        forward.autocast_bf16 = was
