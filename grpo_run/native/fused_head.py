"""The LM head fused into the chunked log-softmax: log-probs of completion tokens from the head's input.

`head_token_logprobs` is `algo.token_logprobs` of `hidden @ weight.T` without the [N, T, V] logits: each
chunk of rows has its logits computed, used and dropped in the forward, and the backward recomputes them
one block of vocabulary columns at a time, so neither the logits nor their gradient ever exist whole. The
arithmetic is the chunk helpers' of `algo/logprobs.py` (the same log-softmax, the same gradient formula),
so its log-probs equal `token_logprobs(model logits)` to float rounding (`tests/native/test_fused_head.py`).
"""

import torch

from grpo_run.algo.logprobs import (
    DEFAULT_CHUNK_SIZE,
    _check,
    _chunks,
    _fill_chunks,
    _logprob_grad,
    _scale_,
    _Workspace,
)

# Handed out in blocks (`head_token_logprobs`'s weight_grad_blocks), the LM head's weight gradient comes
# in blocks of at least this many bytes: above the size from which grpo_run's malloc maps a block on its
# own (grpo_run/native/heap.py, 4 MB), so that each block's memory goes back to the OS as soon as it is freed.
GRAD_BLOCK_BYTES = 8 * 2**20


def _empty_rows(first: int, end: int, weight: torch.Tensor, dtype: torch.dtype) -> tuple[slice, torch.Tensor]:
    """(rows first..end-1, an uninitialised [end - first, H] tensor for their gradient)."""
    return slice(first, end), torch.empty(end - first, weight.shape[1], dtype=dtype, device=weight.device)


class _HeadTokenLogprobs(torch.autograd.Function):
    """`_TokenLogprobs` of logits = hidden @ weight.T without the [R, V] logits or their gradient: the
    forward runs `chunk_size` rows at a time and keeps each row's logsumexp; the backward recomputes the
    logits one block of vocabulary columns at a time for all rows (a block holds half as many elements
    as a chunk of rows), so each block's weight gradient is one matmul over all rows and the gradient
    of hidden sums over the blocks.

    hidden [R, H], weight [V, H], targets [R] -> ([R], [R] or None). `dtype`: the matmuls' (bf16 under
    autocast, as autocast would run the LM head): logits in dtype, the gradients of the logits in dtype,
    the weight's gradient rounded to dtype once, hidden's summed over blocks in float32 and rounded once.
    `grad_blocks`: a list that takes the weight's gradient as (rows, [rows, H] block) pairs instead of
    autograd (which then sees none), for a consumer that frees it block by block.
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, chunk_size, with_entropy, dtype, grad_blocks=None):
        float_dtype = torch.promote_types(dtype, torch.float32)
        (rows, vocab), device = (hidden.shape[0], weight.shape[0]), hidden.device
        out = torch.empty(rows, dtype=float_dtype, device=device)  # [R]
        lse = torch.empty_like(out)  # [R] logsumexp of each row's scaled logits
        entropy = torch.empty_like(out) if with_entropy else None  # [R]
        w = weight.to(dtype)  # [V, H]

        def logits_of(r: slice, ws: _Workspace) -> torch.Tensor:  # [C, V] in dtype
            return torch.matmul(
                hidden[r].to(dtype), w.T, out=ws.get("logits", (r.stop - r.start, vocab), dtype)
            )

        with torch.autocast(device.type, enabled=False):  # dtypes are explicit here
            _fill_chunks(logits_of, vocab, targets, temperature, chunk_size, out, entropy, lse)
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.temperature, ctx.chunk_size, ctx.dtype = temperature, chunk_size, dtype
        ctx.grad_blocks = grad_blocks
        if with_entropy:
            ctx.mark_non_differentiable(entropy)
        return out, entropy

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out, _grad_entropy):
        hidden, weight, targets, lse = ctx.saved_tensors
        (rows, vocab), dtype, device = (hidden.shape[0], weight.shape[0]), ctx.dtype, hidden.device
        h = hidden.to(dtype)  # [R, H]
        need_hidden, need_weight = ctx.needs_input_grad[:2]  # a frozen LM head needs no weight gradient
        grad_hidden = torch.zeros(hidden.shape, dtype=grad_out.dtype, device=device) if need_hidden else None
        # Vocabulary columns per block: half a forward chunk's elements. The backward starts while every
        # checkpointed layer's input is held and the weight's gradient fills up, so a block's bf16
        # logits and their float32 copy are one of the update's memory peaks: half a chunk's elements
        # halves them, at the same speed.
        step = max(1, ctx.chunk_size * vocab // (2 * rows))
        blocks = ctx.grad_blocks if need_weight else None
        # The weight's gradient [V, H] in dtype: one tensor, or for `grad_blocks` tensors of whole blocks.
        per = (
            vocab
            if blocks is None
            else step * -(-GRAD_BLOCK_BYTES // (step * weight.shape[1] * h.element_size()))
        )
        storage = (
            [_empty_rows(a, min(a + per, vocab), weight, dtype) for a in range(0, vocab, per)]
            if need_weight
            else []
        )
        ws = _Workspace(device)
        with torch.autocast(device.type, enabled=False):
            for cols in _chunks(vocab, step):
                width = cols.stop - cols.start
                w = weight[cols].to(dtype)  # [Vb, H]
                logits = torch.matmul(h, w.T, out=ws.get("logits", (rows, width), dtype))  # [R, Vb]
                x = _scale_(ws.get("x", (rows, width), grad_out.dtype).copy_(logits), ctx.temperature)
                grad = _logprob_grad(x, lse, targets, grad_out, ctx.temperature, cols.start)  # [R, Vb]
                g = logits.copy_(grad)  # in dtype, over the logits (no longer needed)
                if need_hidden:
                    grad_hidden += g @ w  # [R, H] this block's share
                if need_weight:
                    first, block = storage[cols.start // per]
                    torch.matmul(
                        g.T, h, out=block[cols.start - first.start : cols.stop - first.start]
                    )  # [Vb, H]
        if need_hidden:  # rounded to dtype once, back in place (no second float32 copy)
            rounded = grad_hidden.to(dtype)
            grad_hidden = (
                grad_hidden.copy_(rounded) if grad_hidden.dtype == hidden.dtype else rounded.to(hidden.dtype)
            )
        grad_weight = None
        if blocks is not None:
            blocks.extend(storage)
        elif need_weight:
            grad_weight = storage[0][1].to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None, None


def head_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    *,
    with_entropy: bool = False,
    dtype: torch.dtype | None = None,
    weight_grad_blocks: list | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`token_logprobs` (and the entropy metric, without gradient) of the logits hidden @ weight.T,
    computed `chunk_size` rows at a time from the LM head's input: hidden [N, T, H], weight [V, H],
    targets [N, T] -> ([N, T], [N, T] or None). The [N, T, V] logits and their gradient never exist
    whole; the backward recomputes each chunk's logits. dtype: the matmul's (default the weight's).
    Differentiable w.r.t. hidden and weight; with `weight_grad_blocks` (a list) the weight's gradient
    (in dtype) is appended to it in blocks of rows, (rows, [rows, H]) of `GRAD_BLOCK_BYTES` or more,
    instead of reaching the weight through autograd (`native/weight_casts.py` sums a tied weight's)."""
    _check(temperature, chunk_size)
    flat, entropy = _HeadTokenLogprobs.apply(
        hidden.reshape(-1, hidden.shape[-1]),
        weight,
        targets.reshape(-1),
        temperature,
        chunk_size,
        with_entropy,
        dtype or weight.dtype,
        weight_grad_blocks,
    )  # [N*T], [N*T] or None
    return flat.reshape(targets.shape), None if entropy is None else entropy.reshape(targets.shape)
