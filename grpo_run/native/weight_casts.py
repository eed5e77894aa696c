"""bf16 casts of the layer weights, made once per optimizer step instead of at every use.

Under bf16 autocast a float32 weight is cast to bf16 at every matmul that uses it: in the forward of
each micro-batch, again when gradient checkpointing recomputes the layer inside the backward, and the
bf16 gradient is cast back to float32 on its way to `.grad`. Within one optimizer step the weights do
not change, so every forward cast of every micro-batch makes the same tensor. `WeightCasts` makes each
once per update (`trainer.update` opens one for its micro-batches; `backend.cast_weights_once`) and the
native forward (`LlamaLayers.linear`) uses it in place of autocast's. The tensor reaches the matmul
through `_Cast`, whose backward is the one autocast's cast has (the gradient cast to the weight's
dtype), so gradients reach the float32 weights along the same graph and with the same bits
(`tests/native/test_weight_casts.py`). Hooks on the weights (DeepSpeed's, DDP's) see the same
accumulation as before.

The projections and the LM head go through it (a tied LM head's gradient meets the embedding's in the
same sum as under autocast); the embedding lookup and the norms run in float32 as before.
"""

import torch


class _Cast(torch.autograd.Function):
    """weight -> its precomputed cast (forward); gradient -> the weight's dtype (backward)."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, cast: torch.Tensor) -> torch.Tensor:
        ctx.dtype = weight.dtype
        return cast.view_as(cast)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad.to(ctx.dtype), None


class _TiedCast(torch.autograd.Function):
    """A tied embedding weight -> (the weight, for the lookup; its precomputed cast, for the LM head).

    One node for both uses, so the head's gradient, which the backward makes first, waits for the
    lookup's in the cast's dtype (a [V, H] bf16 tensor) instead of autograd holding it in float32
    (twice the bytes) through the whole backward. The sum is autograd's own for a weight used
    twice, in its order: the head's gradient cast to the weight's dtype, plus the lookup's (sparse).
    The fused LM head hands its gradient over in blocks of rows (`grad_blocks`, filled by
    `native/fused_head.py`) rather than through autograd: each block is converted into the
    float32 sum and freed in turn, so the bf16 copy and the float32 sum never both exist whole (one
    [V, H] bf16 tensor less at the end of the backward)."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, cast: torch.Tensor, grad_blocks: list):
        ctx.dtype, ctx.grad_blocks = weight.dtype, grad_blocks
        ctx.set_materialize_grads(False)  # an output without a gradient stays None, not a dense zero
        return weight.view_as(weight), cast.view_as(cast)

    @staticmethod
    def backward(ctx, grad_lookup: torch.Tensor | None, grad_head: torch.Tensor | None):
        if grad_head is not None:
            total = grad_head.to(ctx.dtype)
        elif ctx.grad_blocks:
            total = _joined(ctx.grad_blocks, ctx.dtype)
        else:
            return grad_lookup, None, None
        if grad_lookup is not None:
            total.add_(grad_lookup)
        return total, None, None


def _joined(blocks: list, dtype: torch.dtype) -> torch.Tensor:
    """The (rows, [rows, H] block) pairs of a whole [V, H] gradient as one `dtype` tensor; each block is
    dropped from the list, and freed, once converted."""
    rows = max(r.stop for r, _ in blocks)
    total = torch.empty(rows, blocks[0][1].size(1), dtype=dtype, device=blocks[0][1].device)
    while blocks:
        rows, block = blocks.pop()
        total[rows] = block  # the same rounding as .to(dtype)
        del block
    return total


class SharedCast:
    """An activation that several matmuls read under autocast (a norm's output: q, k and v; gate and up),
    cast once instead of once per matmul. Each call hands the cast out through its own `_Cast`, so each
    use's gradient goes back to the activation's dtype on its own and autograd sums them there, as after
    autocast's cast at every use: the same bits. The matmuls then keep one copy for their backward
    instead of one each (per layer three copies fewer: two of q/k/v's input, one of gate/up's)."""

    def __init__(self, x: torch.Tensor, dtype: torch.dtype) -> None:
        self.x = x
        self.cast = x.detach().to(dtype)  # round to nearest even, as autocast's cast

    def __call__(self) -> torch.Tensor:
        return _Cast.apply(self.x, self.cast)


class WeightCasts:
    """Casts to `dtype` of the weights it is asked for, each made at its first use and kept until the
    object is dropped. Valid only while those weights do not change: one optimizer step."""

    def __init__(self, dtype: torch.dtype = torch.bfloat16) -> None:
        self.dtype = dtype
        self._casts: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(weight) -> (weight, its cast)
        self._last_use = False
        self.made = 0  # casts made (one per weight and optimizer step, plus the recomputations' below)

    def __call__(self, weight: torch.Tensor) -> torch.Tensor:
        """`weight` as the matmul under autocast would see it, with the gradient flowing back to it."""
        return _Cast.apply(weight, self._cast_of(weight))

    def tied(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list]:
        """A weight that an embedding lookup and the LM head share: (the weight for the lookup, its cast
        for the head, the list the fused head may hand its gradient over in), the first two joined to it
        by one node (`_TiedCast`). The same gradient, bit for bit."""
        grad_blocks: list = []
        lookup, cast = _TiedCast.apply(weight, self._cast_of(weight), grad_blocks)
        return lookup, cast, grad_blocks

    def _cast_of(self, weight: torch.Tensor) -> torch.Tensor:
        entry = self._casts.pop(id(weight), None) if self._last_use else self._casts.get(id(weight))
        if entry is None or entry[0] is not weight:
            # Round to nearest even, as autocast's cast does; made without autograd, joined by the caller.
            entry = (weight, weight.detach().to(self.dtype))
            self.made += 1
            if not self._last_use:
                self._casts[id(weight)] = entry
        return entry[1]

    def release_on_use(self) -> None:
        """Called before the update's last forward: from then on a lookup hands a kept cast out one last
        time, or makes a fresh one, and keeps nothing, so that each cast lives only as long as the graph
        that uses it. A checkpointed layer's forward holds no graph, so its recomputation in the
        backward casts afresh: one more cast of the layers per update, a small cost in time, instead
        of every layer's cast waiting through the rest of the forward and the backward, which the peak
        of the update's memory would pay."""
        self._last_use = True

    def __len__(self) -> int:
        return len(self._casts)
