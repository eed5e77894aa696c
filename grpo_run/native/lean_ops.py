"""Steps of a decoder layer that keep less for the backward, with autograd's numbers.

In a checkpointed layer's recomputation every tensor that autograd saves for the backward exists at
once, while every gradient made so far waits for the optimizer step: at the end of the update's
backward this is the peak of a step's memory. Each step here saves its inputs only and recomputes its
output's intermediates in the backward (element-wise ops and the attention's small score matmul, cheap
beside the layer's projections), with the same ops, in the same order, as autograd's own backward of
the unfused ops: the same gradients bit for bit (`tests/native/test_lean_ops.py`). Per layer, for N token
positions, an MLP width F and attention scores [n, heads, t, s]:

- `swiglu(gate, up)` = silu(gate) · up: autograd keeps gate, silu(gate) and up (three [N, F] tensors);
  this keeps gate and up.
- `softmax_rounded(scores)` = softmax in float32, rounded back to the scores' dtype (transformers'
  eager attention): autograd keeps the float32 probabilities beside the rounded ones that the next
  matmul keeps; this keeps the bf16 scores (half the bytes) instead of the float32 probabilities.
- `attention_core(q, k, v, keys_ok)` = softmax_rounded(masked q·kᵀ)·v: the two matmuls keep q, k, the
  rounded probabilities and v, and the softmax its scores (two score-sized tensors); this keeps q, k, v
  and the mask, and recomputes the scores and probabilities in the backward.
- `swiglu_linear(gate, up, weight)` = (silu(gate) · up)·weightᵀ, the MLP's down projection: the matmul
  keeps its input (one more [N, F]); this keeps gate and up, which `swiglu` keeps anyway, and recomputes
  it.
"""

import torch
import torch.nn.functional as F


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return F.silu(gate).mul_(up)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        gate, up = ctx.saved_tensors
        return _swiglu_grads(grad, gate, up, *ctx.needs_input_grad)


def _swiglu_grads(grad, gate, up, need_gate: bool, need_up: bool, *, grad_is_temporary: bool = False):
    """Autograd's gradients of silu(gate) · up: silu(gate) · grad (the same product as grad · silu(gate))
    for up; mul's backward (grad · up), then silu's, for gate. `grad_is_temporary`: the caller's own
    tensor, which then holds gate's gradient (one [..., F] tensor fewer at a time)."""
    grad_up = F.silu(gate).mul_(grad) if need_up else None
    if not need_gate:
        return None, grad_up
    if not grad_is_temporary:
        return torch.ops.aten.silu_backward(grad * up, gate), grad_up
    grad = grad.mul_(up)
    return torch.ops.aten.silu_backward.grad_input(grad, gate, grad_input=grad), grad_up


class _SoftmaxRounded(torch.autograd.Function):
    @staticmethod
    def forward(ctx, scores: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(scores)
        return torch.softmax(scores, dim=-1, dtype=torch.float32).to(scores.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (scores,) = ctx.saved_tensors
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32)  # the forward's, recomputed
        return _softmax_rounded_grad(grad, probs, scores.dtype)


def _softmax_rounded_grad(grad: torch.Tensor, probs32: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Autograd's chain for softmax(x, dtype=float32).to(x.dtype), given the float32 probabilities: the
    rounding's backward (to float32), softmax's, then the input conversion's (back to x's `dtype`)."""
    return torch._softmax_backward_data(grad.to(torch.float32), probs32, -1, torch.float32).to(dtype)


class _AttentionCore(torch.autograd.Function):
    """q [n, kv, g·t, d] (scaled, a key/value head's g query heads as rows), k, v [n, kv, s, d],
    keys_ok [n, 1, t, s] -> [n, kv, g·t, d]. The backward is autograd's chain for `_core_output`:
    the second matmul's, the rounded softmax's (`_SoftmaxRounded`), masked_fill's, the first matmul's,
    with each matmul's backward as the batched matmuls autograd runs (`_bmm_grads`)."""

    @staticmethod
    def forward(ctx, q, k, v, keys_ok, heads: int):
        ctx.save_for_backward(q, k, v, keys_ok)
        ctx.heads = heads
        return _core_output(softmax_rounded(_core_scores(q, k, keys_ok, heads)), v)  # no grad recorded here

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        q, k, v, keys_ok = ctx.saved_tensors
        n, kv, rows, d = q.shape
        s = k.size(2)
        # Each intermediate is dropped once used: the recomputation's transients are this layer's
        # largest tensors ([n, heads, t, s], float32 for the softmax).
        masked = _core_scores(q, k, keys_ok, ctx.heads)  # [n, heads, t, s]
        shape, dtype = masked.shape, masked.dtype
        probs32 = torch.softmax(masked, dim=-1, dtype=torch.float32)
        del masked
        probs = probs32.to(dtype)
        grad_probs, grad_v = _bmm_grads(grad, probs.view(n * kv, rows, s), v.reshape(n * kv, s, d))
        del probs
        grad_scores = _softmax_rounded_grad(grad_probs.view(shape), probs32, dtype)
        del grad_probs, probs32
        grad_scores = grad_scores.masked_fill_(~keys_ok, 0).view(n * kv, rows, s)
        grad_q, grad_kt = _bmm_grads(
            grad_scores, q.reshape(n * kv, rows, d), k.transpose(2, 3).reshape(n * kv, d, s)
        )
        return (
            grad_q.view(q.shape),
            grad_kt.view(n, kv, d, s).transpose(2, 3),
            grad_v.view(v.shape),
            None,
            None,
        )


def _core_scores(q, k, keys_ok, heads: int) -> torch.Tensor:
    """The masked attention scores [n, heads, t, s] (masked keys at the dtype's lowest value)."""
    n, _, rows, _ = q.shape
    scores = torch.matmul(q, k.transpose(2, 3)).view(n, heads, rows * q.size(1) // heads, k.size(2))
    return scores.masked_fill(~keys_ok, torch.finfo(scores.dtype).min)


def _core_output(probs: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    n, kv = v.shape[:2]
    return torch.matmul(probs.view(n, kv, -1, probs.size(-1)), v)  # [n, kv, g·t, d]


def _bmm_grads(grad: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of a.bmm(b) (a [B, m, k], b [B, k, p]) for grad [.., m, p], as autograd's bmm
    backward computes them: grad·bᵀ and aᵀ·grad."""
    grad = grad.reshape(a.size(0), a.size(1), b.size(2))
    return grad.bmm(b.transpose(1, 2)), a.transpose(1, 2).bmm(grad)


class _SwiGLULinear(torch.autograd.Function):
    """gate, up [..., F], weight [H, F] (the activations' dtype, no bias) -> [..., H]. The backward is
    autograd's for `F.linear(x, weight)` on x [..., F] (one mm for x's gradient and one for the
    weight's, transposed as autograd's mm backward makes them) and then `_SwiGLU`'s."""

    @staticmethod
    def forward(ctx, gate, up, weight):
        ctx.save_for_backward(gate, up, weight)
        return F.linear(F.silu(gate).mul_(up), weight)  # the product in silu's buffer: one transient

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        gate, up, weight = ctx.saved_tensors
        grad_2d = grad.reshape(-1, grad.size(-1))  # [N, H]
        grad_gate = grad_up = grad_weight = None
        if ctx.needs_input_grad[2]:
            x = F.silu(gate).mul_(up).reshape(-1, gate.size(-1))  # [N, F]: the forward's input, recomputed
            grad_weight = grad_2d.t().mm(x)  # [H, F]
            del x  # the layer's largest activations: one [N, F] at a time
        if ctx.needs_input_grad[0] or ctx.needs_input_grad[1]:
            grad_x = grad_2d.mm(weight).view(gate.shape)  # [..., F]
            grad_gate, grad_up = _swiglu_grads(
                grad_x, gate, up, *ctx.needs_input_grad[:2], grad_is_temporary=True
            )
        return grad_gate, grad_up, grad_weight


# Below this many elements (1 MB in float32, 512 KB in bf16) the memory kept is small, and a Python
# autograd node's overhead is the larger cost (a small model's step is mostly per-kernel dispatch). The
# numbers are the same either way.
LEAN_MIN_ELEMENTS = 2**18


def _recording(elements: int, *tensors: torch.Tensor) -> bool:
    """Autograd records an op on `tensors`, and its largest kept tensor (`elements`) is worth a lean step."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors) and elements >= LEAN_MIN_ELEMENTS


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) · up, [..., F] each; under autograd keeping only gate and up for the backward."""
    return _SwiGLU.apply(gate, up) if _recording(gate.numel(), gate, up) else F.silu(gate) * up


def attention_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys_ok: torch.Tensor, heads: int):
    """softmax_rounded(q·kᵀ with masked keys at the dtype's lowest value)·v: q [n, kv, g·t, d] (scaled,
    grouped), k, v [n, kv, s, d], keys_ok [n, 1, t, s] -> [n, kv, g·t, d]; under autograd keeping q, k,
    v and the mask only."""
    n, kv, rows, _ = q.shape
    if not _recording(n * kv * rows * k.size(2), q, k, v):  # the scores' elements
        return _core_output(softmax_rounded(_core_scores(q, k, keys_ok, heads)), v)
    device = q.device.type
    if torch.is_autocast_enabled(device):
        # Autocast's casts of the matmuls' inputs, made here (the same rounding and backward) so that
        # the fused step runs in one dtype; the float32 rotary output (q, k) becomes bf16.
        dtype = torch.get_autocast_dtype(device)
        q, k, v = (x.to(dtype) for x in (q, k, v))
    with torch.autocast(device, enabled=False):
        return _AttentionCore.apply(q, k, v, keys_ok, heads)


def swiglu_linear(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.linear(silu(gate) · up, weight), weight [H, F] in the activations' dtype and without bias; under
    autograd keeping gate, up and the weight only."""
    if _recording(gate.numel(), gate, up, weight):
        return _SwiGLULinear.apply(gate, up, weight)
    return F.linear(swiglu(gate, up), weight)


def softmax_rounded(scores: torch.Tensor) -> torch.Tensor:
    """softmax over the last dim in float32, rounded to the scores' dtype; under autograd with
    half-precision scores keeping those scores rather than the float32 probabilities."""
    # In float32 the probabilities are the output itself: nothing to keep instead.
    if scores.dtype == torch.float32 or not _recording(scores.numel(), scores):
        return torch.softmax(scores, dim=-1, dtype=torch.float32).to(scores.dtype)
    return _SoftmaxRounded.apply(scores)
