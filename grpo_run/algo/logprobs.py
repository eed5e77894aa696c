"""Per-token log-probs and entropies from logits, without a full [N, T, V] float32 tensor alive at once.

The N*T rows are processed `chunk_size` rows at a time, each chunk upcast to float32 (float64 stays
float64). Autograd is done by hand (small `autograd.Function`s) so that only the original logits are
saved for backward: backward recomputes each chunk's softmax, instead of autograd keeping every chunk's
float32 copy alive between forward and backward. Results are float32 [N, T].
The fast path's fused LM head (`grpo_run/native/fused_head.py`) builds on the same chunk helpers and
starts from the LM head's input instead of the logits.
"""

import math
from collections.abc import Callable

import torch

DEFAULT_CHUNK_SIZE = 512  # rows per chunk: 512 x 152k vocab x 4 B ~ 300 MB transient


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
        # arithmetic without its [C, V] product (another [C, V] float32 tensor).
        entropy.copy_(torch.exp(logp, out=x).mul_(logp).sum(-1).neg_())


class _Workspace:
    """Buffers that every chunk of one call writes again. A fresh [chunk, V] float32 tensor per chunk
    is a fresh mapping of tens of MB whose pages fault in one by one, so writing into a new tensor costs
    several times what writing into a used one does."""

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
