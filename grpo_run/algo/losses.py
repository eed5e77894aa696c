"""The clipped GRPO policy loss and the aggregations that turn per-token losses into one scalar.

Shapes: N completions (rows), T completion positions. `mask` [N, T] is bool or float (1 on completion
tokens, 0 on padding and after EOS). Values at masked-out positions never reach a result, even when
they are inf or NaN: they are replaced with 0 before any arithmetic that could spread them.
"""

from collections.abc import Callable
from typing import NamedTuple

import torch

from grpo_run.algo.enums import Aggregation, ImportanceLevel, KLEstimator
from grpo_run.algo.kl import kl_divergence

# Log-ratios (token or sequence level) are clamped to this band before exp, so a pathological token
# cannot turn the loss inf; exp(20) ~ 4.9e8 is far beyond any ratio the clip would let through.
LOG_RATIO_CLAMP = 20.0


def _safe_div(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """num / den, and 0 where den == 0 (num is then 0 as well: nothing was summed)."""
    return num / torch.where(den != 0, den, torch.ones_like(den))


def _masked(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """x with masked-out entries set to 0 and kept ones weighted by a float mask. [N, T] -> [N, T]."""
    return torch.where(mask != 0, x, torch.zeros_like(x)) * mask.to(x.dtype)  # [N, T]


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of x over the mask (all of it, or along `dim`); 0 where the mask is empty.

    x, mask: [N, T]. Returns a scalar, or x reduced along `dim`.
    """
    weights = mask.to(x.dtype)  # [N, T]
    if dim is None:
        return _safe_div(_masked(x, mask).sum(), weights.sum())  # []
    return _safe_div(_masked(x, mask).sum(dim), weights.sum(dim))  # x.shape without dim


def _denominator(normalizer: torch.Tensor | float | None, local: torch.Tensor | float, like: torch.Tensor):
    """The step-level normalizer when given, else this batch's own count, as a tensor like `like`."""
    count = local if normalizer is None else normalizer
    return torch.as_tensor(count, dtype=like.dtype, device=like.device)  # []


def _per_token(masked_loss, weights, normalizer, constant_length):
    tokens = _denominator(normalizer, weights.sum(), masked_loss)  # []
    return _safe_div(masked_loss.sum(), tokens)  # []


def _per_response(masked_loss, weights, normalizer, constant_length):
    per_completion = _safe_div(masked_loss.sum(-1), weights.sum(-1))  # [N]
    completions = _denominator(normalizer, float(masked_loss.shape[0]), masked_loss)  # []
    return _safe_div(per_completion.sum(), completions)  # []


def _constant_length(masked_loss, weights, normalizer, constant_length):
    if constant_length is None:
        raise ValueError("aggregation=constant_length needs constant_length (the fixed L), got None")
    per_completion = masked_loss.sum(-1) / constant_length  # [N]
    completions = _denominator(normalizer, float(masked_loss.shape[0]), masked_loss)  # []
    return _safe_div(per_completion.sum(), completions)  # []


# One signature: (masked loss [N, T], mask weights [N, T], normalizer, constant_length) -> scalar.
AggregateFn = Callable[[torch.Tensor, torch.Tensor, object, object], torch.Tensor]

AGGREGATIONS: dict[Aggregation, AggregateFn] = {
    Aggregation.PER_TOKEN: _per_token,
    Aggregation.PER_RESPONSE: _per_response,
    Aggregation.CONSTANT_LENGTH: _constant_length,
}


def aggregate(
    per_token_loss: torch.Tensor,
    mask: torch.Tensor,
    aggregation: Aggregation | str,
    normalizer: torch.Tensor | float | None = None,
    constant_length: float | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss [N, T] over the completion mask [N, T] to a scalar.

    per_response: sum_i (sum_t m l / sum_t m) / normalizer (an empty row adds 0 but still counts);
    per_token: sum m l / normalizer; constant_length: sum_i (sum_t m l / constant_length) / normalizer.
    normalizer is the step-level denominator, so micro-batches (and ranks) that each pass it sum to
    the whole-step loss: per_token -> completion tokens of the step, per_response and
    constant_length -> completions of the step. None uses this batch's own count.
    """
    agg = Aggregation(aggregation)
    weights = mask.to(per_token_loss.dtype)  # [N, T]
    masked_loss = _masked(per_token_loss, mask)  # [N, T]
    return AGGREGATIONS[agg](masked_loss, weights, normalizer, constant_length)  # []


class PolicyLossOutput(NamedTuple):
    loss: torch.Tensor  # [] aggregated loss, with grad
    kl: torch.Tensor  # [] detached masked mean of the per-token KL (0 when beta == 0 or no ref)
    clip_fraction: torch.Tensor  # [] detached: low + high
    clip_fraction_low: torch.Tensor  # [] detached: share of tokens with ratio < 1 - eps and A < 0
    clip_fraction_high: torch.Tensor  # [] detached: share of tokens with ratio > 1 + eps_high and A > 0
    entropy: torch.Tensor  # [] detached masked mean of the per-token entropy (0 when not given)


def _log_ratio(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor, level: ImportanceLevel
) -> torch.Tensor:
    """log(pi_theta / pi_old) per token [N, T], token level or GSPO's sequence level."""
    token = torch.where(mask != 0, logprobs - old_logprobs, torch.zeros_like(logprobs))  # [N, T]
    if level is ImportanceLevel.TOKEN:
        return token.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # [N, T]
    # GSPO-token form: value = the sequence's length-normalised log-ratio on every token, gradient
    # = d log pi_theta(token). Aggregated with equal weights inside a completion (all our modes), the
    # gradient equals GSPO's d s_i = s_i * mean_t d log pi_theta.
    seq = masked_mean(token, mask, dim=-1).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # [N]
    safe_logprobs = torch.where(mask != 0, logprobs, torch.zeros_like(logprobs))  # [N, T]
    return seq.detach().unsqueeze(-1) + safe_logprobs - safe_logprobs.detach()  # [N, T]


def _is_zero(x: torch.Tensor | float) -> bool:
    """True only for a plain number equal to 0; a tensor is never inspected (no host sync)."""
    return not isinstance(x, torch.Tensor) and x == 0


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    epsilon: float,
    epsilon_high: float,
    beta: torch.Tensor | float,
    aggregation: Aggregation | str,
    normalizer: torch.Tensor | float | None = None,
    constant_length: float | None = None,
    clip_ratio_c: float | None = None,
    kl_estimator: KLEstimator | str = "k3",
    importance_level: ImportanceLevel | str = "token",
    entropy: torch.Tensor | None = None,
    entropy_coef: torch.Tensor | float = 0.0,
    token_weights: torch.Tensor | None = None,
) -> PolicyLossOutput:
    """Clipped GRPO loss. logprobs/old_logprobs/ref_logprobs/mask/entropy: [N, T]; advantages: [N].

    ratio = exp(log pi_theta - log pi_old) per token (importance_level="sequence": GSPO's
    exp(mean_t log-ratio) shared by the completion's tokens); surrogate = min(ratio A,
    clip(ratio, 1 - epsilon, 1 + epsilon_high) A); with clip_ratio_c = c > 1 and A < 0 the surrogate
    is raised to at least c A (dual clip); `token_weights` [N, T] (detached, e.g. the sampler
    correction of `rollout_correction.py`) multiply the surrogate, not the KL or entropy terms, as
    TRL and verl weight it. Per-token loss l = -(surrogate - beta kl) - entropy_coef H,
    then `aggregate`. Metrics are detached masked means over this batch's completion tokens.
    """
    level = ImportanceLevel(importance_level)
    if clip_ratio_c is not None and clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1 (dual clip), got {clip_ratio_c}")

    ratio = torch.exp(_log_ratio(logprobs, old_logprobs, mask, level))  # [N, T]
    adv = advantages.to(ratio.dtype).unsqueeze(-1)  # [N, 1]
    unclipped = ratio * adv  # [N, T]
    clipped = ratio.clamp(1.0 - epsilon, 1.0 + epsilon_high) * adv  # [N, T]
    surrogate = torch.minimum(unclipped, clipped)  # [N, T]
    if clip_ratio_c is not None:
        # For A < 0 the unclipped branch is unbounded below as the ratio grows; cap the loss at -c A.
        surrogate = torch.where(adv < 0, torch.maximum(surrogate, clip_ratio_c * adv), surrogate)  # [N, T]
    if token_weights is not None:
        surrogate = surrogate * token_weights.detach().to(surrogate.dtype)  # [N, T]
    per_token = -surrogate  # [N, T]

    kl = torch.zeros_like(ratio)  # [N, T]
    if ref_logprobs is not None and not _is_zero(beta):
        # Both sides zeroed off the mask: d = 0 there, so padding garbage cannot reach a gradient.
        safe_lp = torch.where(mask != 0, logprobs, torch.zeros_like(logprobs))  # [N, T]
        safe_ref = torch.where(mask != 0, ref_logprobs, torch.zeros_like(ref_logprobs))  # [N, T]
        kl = kl_divergence(safe_lp, safe_ref, kl_estimator)  # [N, T]
        per_token = per_token + beta * kl  # [N, T]

    ent = torch.zeros_like(ratio) if entropy is None else _masked(entropy, mask)  # [N, T]
    if entropy is not None and not _is_zero(entropy_coef):
        per_token = per_token - entropy_coef * ent  # [N, T]

    loss = aggregate(per_token, mask, aggregation, normalizer=normalizer, constant_length=constant_length)

    with torch.no_grad():
        low = ((ratio < 1.0 - epsilon) & (adv < 0)).to(ratio.dtype)  # [N, T]
        high = ((ratio > 1.0 + epsilon_high) & (adv > 0)).to(ratio.dtype)  # [N, T]
        frac_low = masked_mean(low, mask)  # []
        frac_high = masked_mean(high, mask)  # []
        kl_mean = masked_mean(kl, mask)  # []
        if isinstance(beta, torch.Tensor):
            kl_mean = kl_mean * (beta != 0)  # [] a zero beta tensor reports 0, without a host sync
    return PolicyLossOutput(
        loss=loss,
        kl=kl_mean,
        clip_fraction=frac_low + frac_high,
        clip_fraction_low=frac_low,
        clip_fraction_high=frac_high,
        entropy=masked_mean(ent.detach(), mask),
    )
