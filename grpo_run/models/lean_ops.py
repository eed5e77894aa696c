"""Two element-wise steps of a decoder layer that keep less for the backward, with autograd's numbers.

In a checkpointed layer's recomputation every tensor that autograd saves for the backward exists at
once, while every gradient made so far waits for the optimizer step: at the end of the update's
backward this is the peak of a step's memory. Each step here saves its inputs only and recomputes its
output's intermediate in the backward (an element-wise op, a few ms a layer), with the same ops, in the
same order, as autograd's own backward of the unfused ops: the same gradients bit for bit
(`tests/unit/test_lean_ops.py`). SmolLM2 at the reference setting (4,296 token positions a layer):

- `swiglu(gate, up)` = silu(gate) · up: autograd keeps gate, silu(gate) and up (3 × 13.2 MB in bf16);
  this keeps gate and up.
- `softmax_rounded(scores)` = softmax in float32, rounded back to the scores' dtype (transformers'
  eager attention): autograd keeps the float32 probabilities (26.2 MB) beside the rounded ones that
  the next matmul keeps (13.1 MB); this keeps the bf16 scores (13.1 MB) instead of the float32 ones.
"""

import torch
import torch.nn.functional as F


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        gate, up = ctx.saved_tensors
        grad_gate = grad_up = None
        if ctx.needs_input_grad[0]:  # mul's backward (grad · up), then silu's
            grad_gate = torch.ops.aten.silu_backward(grad * up, gate)
        if ctx.needs_input_grad[1]:
            grad_up = grad * F.silu(gate)
        return grad_gate, grad_up


class _SoftmaxRounded(torch.autograd.Function):
    @staticmethod
    def forward(ctx, scores: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(scores)
        return torch.softmax(scores, dim=-1, dtype=torch.float32).to(scores.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (scores,) = ctx.saved_tensors
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32)  # the forward's, recomputed
        # autograd's chain for softmax(x, dtype=float32).to(x.dtype): the rounding's backward (to
        # float32), softmax's, then the input conversion's (back to x's dtype).
        grad = torch._softmax_backward_data(grad.to(torch.float32), probs, -1, torch.float32)
        return grad.to(scores.dtype)


# Below this many elements the memory kept is a few hundred KB, and a Python autograd node's overhead
# (~0.1 ms a micro-batch on the tiny model, whose step is per-kernel dispatch) is the larger cost. The
# numbers are the same either way.
LEAN_MIN_ELEMENTS = 2**18


def _recording(*tensors: torch.Tensor) -> bool:
    return (
        torch.is_grad_enabled()
        and any(t.requires_grad for t in tensors)
        and tensors[0].numel() >= LEAN_MIN_ELEMENTS
    )


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) · up, [..., F] each; under autograd keeping only gate and up for the backward."""
    return _SwiGLU.apply(gate, up) if _recording(gate, up) else F.silu(gate) * up


def softmax_rounded(scores: torch.Tensor) -> torch.Tensor:
    """softmax over the last dim in float32, rounded to the scores' dtype; under autograd with
    half-precision scores keeping those scores rather than the float32 probabilities."""
    if scores.dtype == torch.float32 or not _recording(scores):  # float32: the probabilities are the output
        return torch.softmax(scores, dim=-1, dtype=torch.float32).to(scores.dtype)
    return _SoftmaxRounded.apply(scores)
