"""Per-token log-probs and entropies from logits, without a full [N, T, V] float32 tensor alive at once.

The N*T rows are processed `chunk_size` rows at a time, each chunk upcast to float32 (float64 stays
float64). Autograd is done by hand (small `autograd.Function`s) so that only the original logits are
saved for backward: backward recomputes each chunk's softmax, instead of autograd keeping every chunk's
float32 copy alive between forward and backward. Results are float32 [N, T].
`head_token_logprobs` goes one step further and starts from the LM head's input: each chunk's logits
are computed, used and dropped, so neither the logits nor their gradient exist whole.
"""

import math
from collections.abc import Callable

import torch

DEFAULT_CHUNK_SIZE = 512  # rows per chunk: 512 x 152k vocab x 4 B ~ 300 MB transient
# Handed out in blocks (`head_token_logprobs`'s weight_grad_blocks), the LM head's weight gradient comes
# in blocks of at least this many bytes: above the size from which grpo_run's malloc maps a block on its
# own (grpo_run/heap.py, 4 MB), so that each block's memory goes back to the OS as soon as it is freed.
GRAD_BLOCK_BYTES = 8 * 2**20


def _compute_dtype(logits: torch.Tensor) -> torch.dtype:
    return torch.promote_types(logits.dtype, torch.float32)


def _chunks(rows: int, chunk_size: int):
    for start in range(0, rows, chunk_size):
        yield slice(start, min(start + chunk_size, rows))


def _check(temperature: float, chunk_size: int) -> None:
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")


def _scaled(x: torch.Tensor, temperature: float) -> torch.Tensor:
    """x / temperature, skipping a full pass over [C, V] when temperature is 1 (the usual case)."""
    return x if temperature == 1.0 else x / temperature


def _p_times(logp: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """exp(logp) * y, with 0 where p == 0 (a -inf logit would otherwise give 0 * -inf = NaN)."""
    return torch.where(logp > -torch.inf, logp.exp() * y, torch.zeros_like(y))


def _scale_(x: torch.Tensor, temperature: float) -> torch.Tensor:
    """x / temperature in place (nothing at a temperature of 1)."""
    return x if temperature == 1.0 else x.mul_(1.0 / temperature)


def _chunk_logprobs(
    x: torch.Tensor,
    targets: torch.Tensor,
    out: torch.Tensor,
    entropy: torch.Tensor | None,
    lse: torch.Tensor | None = None,
    logp: torch.Tensor | None = None,
) -> None:
    """Into out [C] (entropy [C], lse [C] where given): log softmax(x)[target], the entropy and the
    logsumexp of x [C, V], the scaled logits (consumed); logp: a [C, V] buffer for the log-softmax."""
    logp = torch.log_softmax(x, dim=-1, out=logp)  # [C, V]
    out.copy_(logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1))
    if lse is not None:
        lse.copy_(x.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - out)  # x_t - logp_t
    if entropy is not None:
        # H = -sum_v p_v log p_v. A -inf logit has p = 0: clamping its log p to the lowest
        # finite value makes its term 0 * finite = 0 instead of 0 * -inf = NaN.
        logp.clamp_(min=torch.finfo(logp.dtype).min)
        # p (into x, no longer needed) times log p in place, then the row sums: `linalg.vecdot`'s
        # arithmetic without its [C, V] product (50 MB at SmolLM2's 256-row chunks).
        entropy.copy_(torch.exp(logp, out=x).mul_(logp).sum(-1).neg_())


class _Workspace:
    """Buffers that every chunk of one call writes again. A fresh [chunk, V] float32 tensor per chunk
    is a fresh mapping of tens of MB whose pages fault in one by one: copying 256 x 49,152 bf16 logits
    to float32 took 29 ms into a new tensor and 10 ms into a used one here."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._flat: dict[str, torch.Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        numel = math.prod(shape)
        flat = self._flat.get(name)
        if flat is None or flat.numel() < numel or flat.dtype != dtype:
            flat = self._flat[name] = torch.empty(numel, dtype=dtype, device=self.device)
        return flat[:numel].view(shape)


def _logprob_grad(
    x: torch.Tensor,
    lse: torch.Tensor,
    targets: torch.Tensor,
    grad_out: torch.Tensor,
    temperature: float,
    first: int = 0,
) -> torch.Tensor:
    """d(sum grad_out · log softmax(x)[target]) / d logits on the vocabulary columns first..first + V' - 1:
    x [C, V'] those columns of logits / temperature (consumed), lse [C] each row's logsumexp over the
    whole vocabulary. d logp[target] / d x_v = onehot(target)_v - softmax(x)_v, times grad_out [C] /
    temperature; the onehot term only in the rows whose target lies in these columns."""
    g = (grad_out / temperature).unsqueeze(-1)  # [C, 1]
    grad = x.sub_(lse.unsqueeze(-1)).exp_().mul_(-g)  # [C, V'] -softmax(x)_v · g
    hit = ((targets >= first) & (targets < first + x.size(-1))).unsqueeze(-1)  # [C, 1]
    column = (targets - first).clamp(0, x.size(-1) - 1).unsqueeze(-1)  # [C, 1]
    return grad.scatter_add_(-1, column, torch.where(hit, g, torch.zeros_like(g)))


def _fill_chunks(
    logits_of: Callable[[slice, _Workspace], torch.Tensor],
    vocab: int,
    targets: torch.Tensor,
    temperature: float,
    chunk_size: int,
    out: torch.Tensor,
    entropy: torch.Tensor | None,
    lse: torch.Tensor | None = None,
) -> None:
    """The forward of both functions below: out [R] (entropy, lse [R] where given) chunk by chunk of
    rows, `logits_of(rows, workspace)` giving a chunk's logits [C, V]; float math in out's dtype."""
    ws = _Workspace(out.device)
    for rows in _chunks(out.shape[0], chunk_size):
        shape = (rows.stop - rows.start, vocab)
        x = _scale_(ws.get("x", shape, out.dtype).copy_(logits_of(rows, ws)), temperature)  # [C, V]
        ent = None if entropy is None else entropy[rows]
        _chunk_logprobs(
            x,
            targets[rows],
            out[rows],
            ent,
            None if lse is None else lse[rows],
            ws.get("logp", shape, out.dtype),
        )


class _TokenLogprobs(torch.autograd.Function):
    """log softmax(logits / temperature)[target] per row, and optionally the entropy of that softmax
    as a by-product of the same pass (no gradient). logits [R, V], targets [R] -> ([R], [R] or None)."""

    @staticmethod
    def forward(ctx, logits, targets, temperature, chunk_size, with_entropy):
        dtype = _compute_dtype(logits)
        out = torch.empty(logits.shape[0], dtype=dtype, device=logits.device)  # [R]
        entropy = torch.empty_like(out) if with_entropy else None  # [R]
        _fill_chunks(
            lambda rows, _ws: logits[rows], logits.shape[1], targets, temperature, chunk_size, out, entropy
        )
        ctx.save_for_backward(logits, targets)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        if with_entropy:
            ctx.mark_non_differentiable(entropy)
        return out, entropy

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out, _grad_entropy):
        logits, targets = ctx.saved_tensors
        grad = torch.empty_like(logits)  # [R, V]
        ws = _Workspace(logits.device)
        for rows in _chunks(logits.shape[0], ctx.chunk_size):
            shape = (rows.stop - rows.start, logits.shape[1])
            x = _scale_(ws.get("x", shape, grad_out.dtype).copy_(logits[rows]), ctx.temperature)  # [C, V]
            lse = torch.logsumexp(x, dim=-1)  # [C]
            grad[rows] = _logprob_grad(x, lse, targets[rows], grad_out[rows], ctx.temperature)  # cast on copy
        return grad, None, None, None, None


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
        # logits and their float32 copy are one of the update's memory peaks (SmolLM2, reference
        # setting: 37 instead of 75 MB, 10-14 MB off the update's peak RSS at the same speed, README).
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


class _TokenEntropy(torch.autograd.Function):
    """Entropy of softmax(logits / temperature) per row. logits [R, V] -> [R]."""

    @staticmethod
    def forward(ctx, logits, temperature, chunk_size):
        out = torch.empty(logits.shape[0], dtype=_compute_dtype(logits), device=logits.device)  # [R]
        for rows in _chunks(logits.shape[0], chunk_size):
            x = _scaled(logits[rows].to(out.dtype), temperature)  # [C, V]
            logp = torch.log_softmax(x, dim=-1)  # [C, V]
            out[rows] = -_p_times(logp, logp).sum(-1)  # [C]
        ctx.save_for_backward(logits, out)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        # H = -sum_v p_v log p_v  =>  dH / d x_v = -p_v (log p_v + H), and x = logits / temperature.
        logits, entropy = ctx.saved_tensors
        grad = torch.empty_like(logits)  # [R, V]
        for rows in _chunks(logits.shape[0], ctx.chunk_size):
            x = _scaled(logits[rows].to(grad_out.dtype), ctx.temperature)  # [C, V]
            logp = torch.log_softmax(x, dim=-1)  # [C, V]
            chunk_grad = -_p_times(logp, logp + entropy[rows].unsqueeze(-1))  # [C, V]
            chunk_grad = _scaled(chunk_grad * grad_out[rows].unsqueeze(-1), ctx.temperature)  # [C, V]
            grad[rows] = chunk_grad.to(logits.dtype)  # [C, V]
        return grad, None, None


def token_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> torch.Tensor:
    """log softmax(logits / temperature) gathered at targets: logits [N, T, V], targets [N, T] -> [N, T].

    Computed as x[target] - logsumexp(x) on chunks of `chunk_size` rows of the flattened N*T rows;
    float32 result (float64 for float64 logits); differentiable w.r.t. logits. targets must be valid
    vocabulary ids everywhere, padding included (mask the result, not the ids).
    """
    _check(temperature, chunk_size)
    vocab = logits.shape[-1]
    flat, _ = _TokenLogprobs.apply(
        logits.reshape(-1, vocab), targets.reshape(-1), temperature, chunk_size, False
    )  # [N*T]
    return flat.reshape(targets.shape)  # [N, T]


def token_logprobs_and_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`token_logprobs` and, from the same log-softmax pass, `token_entropy` without gradient (the
    entropy as a metric): logits [N, T, V], targets [N, T] -> ([N, T], [N, T]). One read of each
    chunk of logits instead of two; the log-probs are differentiable as in `token_logprobs`."""
    _check(temperature, chunk_size)
    vocab = logits.shape[-1]
    flat, entropy = _TokenLogprobs.apply(
        logits.reshape(-1, vocab), targets.reshape(-1), temperature, chunk_size, True
    )  # [N*T], [N*T]
    return flat.reshape(targets.shape), entropy.reshape(targets.shape)  # [N, T], [N, T]


def token_entropy(
    logits: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> torch.Tensor:
    """Entropy of softmax(logits / temperature) per position: logits [N, T, V] -> [N, T], chunked like
    `token_logprobs`, float32 (float64 for float64 logits), differentiable w.r.t. logits."""
    _check(temperature, chunk_size)
    vocab = logits.shape[-1]
    flat = _TokenEntropy.apply(logits.reshape(-1, vocab), temperature, chunk_size)  # [N*T]
    return flat.reshape(logits.shape[:-1])  # [N, T]


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
    instead of reaching the weight through autograd (`models/weight_casts.py` sums a tied weight's)."""
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
