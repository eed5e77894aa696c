"""Dropout in RL: off by default (`model.disable_dropout`, TRL's `disable_dropout=True`), and never in a
pass without gradient.

Why off: GRPO compares log-probs of the same tokens computed in different passes (π_old against π_θ at
μ > 1, the student against a teacher that is the student itself). With dropout each pass draws its own
mask, so two passes over the same weights disagree and the ratio clips on noise.
"""

import contextlib
from collections.abc import Iterator

import torch

# Module attributes that transformers' attention classes read as a dropout probability in training
# (e.g. LlamaAttention.attention_dropout); nn.Dropout modules are found by type.
_RATE_ATTRIBUTES = ("attention_dropout", "attn_dropout", "dropout")


def disable_dropout(model: torch.nn.Module) -> list[str]:
    """Set every dropout of `model` to 0 in place: nn.Dropout modules (PEFT's lora_dropout included) and
    the float rates attention modules keep as attributes. The model's config (what final/ saves) is left as
    the user's. Returns the names of what had a non-zero rate (for the start line)."""
    zeroed: list[str] = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd):
            if module.p:
                zeroed.append(name)
            module.p = 0.0
            continue
        for attr in _RATE_ATTRIBUTES:
            rate = getattr(module, attr, None)
            if isinstance(rate, float) and not isinstance(rate, bool):
                if rate:
                    zeroed.append(f"{name}.{attr}" if name else attr)
                setattr(module, attr, 0.0)
    return zeroed


@contextlib.contextmanager
def eval_mode(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """`model` in eval mode for a pass without gradient, its train/eval state restored after: π_old, π_ref
    and a teacher never see a dropout mask, whatever `model.disable_dropout` says."""
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)


def describe(zeroed: list[str], *, disabled: bool, lora_dropout: float) -> str | None:
    """The start line about dropout, or None when there is nothing to say (no dropout anywhere)."""
    if disabled:
        if not zeroed:
            return None
        return (
            f"dropout: off (model.disable_dropout=true, as TRL's default): {len(zeroed)} dropout rate(s) "
            f"set to 0, e.g. {zeroed[0]}"
            + (f"; lora.dropout={lora_dropout} is not applied" if lora_dropout else "")
        )
    return (
        "dropout: on in the update's forward (model.disable_dropout=false); π_old, π_ref and the "
        "teacher's passes run in eval mode, without it"
    )
