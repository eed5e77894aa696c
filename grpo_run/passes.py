"""The update's own passes: log-probs of a rollout's completions under a model, micro-batched (π_old and
π_ref for the update, a distillation teacher's, and the behaviour policy's for a batch sampled by another
process under rollout=async). Beside update.py, which runs them; the asynchronous worker imports this
module and never the update."""

import contextlib
from collections.abc import Callable

import torch

from grpo_run.micro_batches import MicroBatch, micro_batches_for
from grpo_run.models.dropout import eval_mode
from grpo_run.models.forward import TrainingForward, trim_columns
from grpo_run.rollout.generate import Rollout


def logprobs_for(
    forward: TrainingForward,
    model,
    rollout: Rollout,
    mb: MicroBatch,
    *,
    with_entropy: bool,
    entropy_grad: bool = False,
):
    """(log-probs, entropy or None) [n, T'] of the micro-batch's completions: packed for a packed
    micro-batch (row indices), else padded with the padding columns trimmed."""
    if isinstance(mb, torch.Tensor):
        return forward.packed_logprobs(
            model,
            rollout.prompt_ids[mb],
            rollout.prompt_mask[mb],
            rollout.completion_ids[mb],
            rollout.completion_mask[mb],
            with_entropy=with_entropy,
            entropy_grad=entropy_grad,
        )
    return padded_logprobs(forward, model, rollout, mb, with_entropy=with_entropy, entropy_grad=entropy_grad)


def padded_logprobs(
    forward: TrainingForward,
    model,
    rollout: Rollout,
    mb: MicroBatch,
    *,
    with_entropy: bool,
    entropy_grad: bool = False,
):
    """(log-probs, entropy or None) [n, T'] of the micro-batch's completions, padding columns trimmed."""
    p_ids, p_mask, c_ids, _ = trim_columns(
        rollout.prompt_ids[mb],
        rollout.prompt_mask[mb],
        rollout.completion_ids[mb],
        rollout.completion_mask[mb],
    )
    return forward.logprobs(model, p_ids, p_mask, c_ids, with_entropy=with_entropy, entropy_grad=entropy_grad)


Between = Callable[[], None]  # called before each micro-batch: the trainer's stop point, or nothing


@torch.no_grad()
def frozen_logprobs(
    rollout: Rollout,
    *,
    forward: TrainingForward,
    model: torch.nn.Module,
    micro_batch_size: int,
    between: Between | None = None,
) -> torch.Tensor:
    """log `model`(completion token | prompt, earlier tokens) of every completion token [N, T] float32,
    without gradient, micro-batched; 0 in the columns a micro-batch trims. The one scoring pass of a model
    that is not being trained at that moment: π_old, π_ref, a distillation teacher (the same completion
    after another prompt is a rollout with its prompt replaced) and a frozen model that scores tokens.

    between: called before each micro-batch. The trainer passes its stop point (`safety.stop`), so a stop
    ends a long pass between two micro-batches; every rank holds the same number of rows, so every rank
    reaches the same stop points. The asynchronous worker's pass has no collective and passes none.

    The model runs in eval mode (`models.dropout.eval_mode`): no dropout mask, so two passes over the same
    weights agree bit for bit and a teacher equal to the student gives exactly 0."""
    full = torch.zeros(
        rollout.completion_ids.shape, dtype=torch.float32, device=rollout.completion_ids.device
    )
    with eval_mode(model):
        if between is not None:  # the first stop point also precedes a packed run's first-step check
            between()
        for i, mb in enumerate(micro_batches_for(rollout, forward, model, micro_batch_size)):
            if between is not None and i > 0:
                between()
            lp = logprobs_for(forward, model, rollout, mb, with_entropy=False)[0]  # [n, T']
            full[mb, : lp.size(1)] = lp
    return full  # [N, T]


def old_and_reference_logprobs(
    rollout: Rollout,
    *,
    forward: TrainingForward,
    old: torch.nn.Module | None,
    reference: Callable[[], contextlib.AbstractContextManager] | None,
    micro_batch_size: int,
    between: Between | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """π_old from `old` (the policy; None when μ = 1, which reuses the detached current log-probs) and π_ref
    from the model `reference()` gives (None when β = 0; with LoRA the policy with its adapter disabled)."""
    models = {
        "old": contextlib.nullcontext(old) if old is not None else None,
        "ref": reference() if reference is not None else None,
    }
    out: dict[str, torch.Tensor | None] = {}
    for name, model_in in models.items():
        if model_in is None:
            out[name] = None
            continue
        with model_in as model:
            out[name] = frozen_logprobs(
                rollout, forward=forward, model=model, micro_batch_size=micro_batch_size, between=between
            )
    return out["old"], out["ref"]


def behaviour_logprobs(rollout: Rollout, *, forward, model, micro_batch_size: int) -> torch.Tensor:
    """log π_behaviour of each sampled token [N, T] (0 past the completion mask): the training forward on
    the weights that sampled the rollout."""
    lp, _ = old_and_reference_logprobs(
        rollout, forward=forward, old=model, reference=None, micro_batch_size=micro_batch_size
    )
    return lp * rollout.completion_mask  # [N, T]
