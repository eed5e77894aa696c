"""A packed run's state and its self-check: on its first packed micro-batch the run computes the
log-probs both ways, packed and padded, and turns packing off for the rest of the run when they differ by
more than float rounding (an attention that leaks across the packed sequences, a model whose forward
ignores restarting positions)."""

from dataclasses import dataclass

import torch

# The largest |packed − padded| per-token log-prob the check accepts. The two forwards run the same
# arithmetic on differently shaped matmuls, so in float32 they differ by rounding only: at most 1.4e-6 on
# the tiny test models, 3.9e-5 on SmolLM2-135M's 30 layers (a micro-batch of 16 rows of the spread
# profile, scripts/bench_packing.py). The check runs in float32 wherever the weights are float32, bf16
# autocast or not: a leak is a matter of which keys a query sees, not of precision, and under bf16 the
# padded path alone moves SmolLM2's log-probs by up to 0.39 when the same rows share a micro-batch with
# other rows (other padding widths), which would hide a mild leak. With bf16 weights (or a
# flash-attention model, whose kernels take no float32) it runs in bf16 and accepts up to 1.0; a
# sequence that sees another's tokens moves a real model's log-probs by several nats.
TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 1.0}


@dataclass
class PackingState:
    """`trainer.padding_free` for one run's training forward: on until its check fails.

    budget: `trainer.micro_batch_tokens` in token-equivalents (None: micro_batch_size times the cost of
    the step's longest row); weight: attention's cost per (query, key) pair (`plan.attention_weight`,
    set from the model on first use); share_prompts: the packed row holds each distinct prompt once."""

    budget: int | None
    share_prompts: bool = False
    weight: float | None = None
    enabled: bool = True
    checked: bool = False
    largest_difference: float | None = None

    def record_check(self, difference: float, dtype: torch.dtype) -> bool:
        """Store the check's largest difference; False (and packing off) when it is over the dtype's
        tolerance."""
        self.checked = True
        self.largest_difference = difference
        self.enabled = difference <= TOLERANCE[dtype]
        return self.enabled


def largest_difference(packed: torch.Tensor, padded: torch.Tensor, mask: torch.Tensor) -> float:
    """max |packed − padded| over the completion tokens (mask [n, T] 1 where a token is); NaN counts as
    infinitely far."""
    diff = (packed.float() - padded.float()).abs().masked_fill(mask == 0, 0.0)
    return float("inf") if bool(diff.isnan().any()) else float(diff.max()) if diff.numel() else 0.0


def off_line(model_name: str, difference: float, dtype: torch.dtype) -> str:
    """The one line a failed check prints."""
    return (
        f"trainer.padding_free: off for this run: packed and padded log-probs of {model_name} differ by "
        f"up to {difference:.3g} (tolerance {TOLERANCE[dtype]:g} in {str(dtype).removeprefix('torch.')}); "
        f"padded micro-batches from here on"
    )
