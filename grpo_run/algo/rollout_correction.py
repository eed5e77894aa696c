"""Importance weights that correct for sampling with a different engine than the one the loss uses.

A separate sampler (vLLM: other kernels, maybe bf16) draws completions from pi_sampler, while the
surrogate's ratio is formed against pi_old (the trainer's own log-probs at generation time). The
policy gradient is then off-policy by rho_s = pi_old / pi_sampler, per token; the corrections here
reweight each token's surrogate by rho_s (token level) or by the completion's product prod_t rho_s
(sequence level), bounded at a cap in one of two ways, as TRL 1.16 (`vllm_importance_sampling_mode`)
defines them:
- truncated importance sampling (TIS): w = min(rho, cap) (and >= floor when a floor is given);
- masking: w = rho where rho <= cap (and >= floor), else 0 (the token, or the whole completion, leaves
  the loss).
Log-ratios are summed (sequence level) and clamped before exp, so a pathological token cannot make
the weight inf; masked-out positions (padding, after EOS) never contribute and get weight 0.
"""

from collections.abc import Callable
from typing import NamedTuple

import torch

from grpo_run.algo.enums import RolloutCorrection

# exp(20) ~ 4.9e8: far above any cap, so the clamp only keeps inf and NaN out of the weights.
_LOG_RHO_CLAMP = 20.0


class CorrectionWeights(NamedTuple):
    weights: torch.Tensor  # [N, T] float32, detached: multiplies the per-token surrogate
    rejected: torch.Tensor  # [N, T] bool: completion tokens a mask mode set to weight 0
    ratio: torch.Tensor  # [N, T] float32: rho_s before bounding (token or sequence level, per mode)


def sampler_log_ratio(
    old_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """log rho_s = log pi_old - log pi_sampler on completion tokens, 0 elsewhere. All [N, T]."""
    diff = old_logprobs.detach().float() - sampler_logprobs.float()  # [N, T]
    return torch.where(mask != 0, diff, torch.zeros_like(diff))  # [N, T]


def _token_log_rho(log_rho: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return log_rho  # [N, T]


def _sequence_log_rho(log_rho: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return log_rho.sum(-1, keepdim=True).expand_as(log_rho)  # [N, T]: the completion's sum on each token


def _truncate(rho: torch.Tensor, cap: float, floor: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    return rho.clamp(min=floor, max=cap), torch.zeros_like(rho, dtype=torch.bool)  # [N, T], [N, T]


def _mask(rho: torch.Tensor, cap: float, floor: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    out = rho > cap  # [N, T]
    if floor is not None:
        out = out | (rho < floor)  # [N, T] IcePop's two-sided band
    return torch.where(out, torch.zeros_like(rho), rho), out


# mode -> (level: log rho per token [N, T], bound: rho -> (weights, rejected)).
_LEVELS: dict[RolloutCorrection, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    RolloutCorrection.TOKEN_TIS: _token_log_rho,
    RolloutCorrection.TOKEN_MASK: _token_log_rho,
    RolloutCorrection.SEQUENCE_TIS: _sequence_log_rho,
    RolloutCorrection.SEQUENCE_MASK: _sequence_log_rho,
}
_BOUNDS: dict[
    RolloutCorrection, Callable[[torch.Tensor, float, float | None], tuple[torch.Tensor, torch.Tensor]]
] = {
    RolloutCorrection.TOKEN_TIS: _truncate,
    RolloutCorrection.SEQUENCE_TIS: _truncate,
    RolloutCorrection.TOKEN_MASK: _mask,
    RolloutCorrection.SEQUENCE_MASK: _mask,
}


def rollout_correction_weights(
    old_logprobs: torch.Tensor,
    sampler_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    mode: RolloutCorrection | str,
    cap: float,
    floor: float | None = None,
) -> CorrectionWeights:
    """Per-token weights of the surrogate from pi_old and pi_sampler log-probs. All inputs [N, T].

    mode none: weights 1 on the mask. Otherwise rho = exp(log rho_s) at the mode's level, then
    truncated (tis) or masked (mask) at `cap`, and from below at `floor` when given (IcePop's two-sided
    bound, TRL's vllm_importance_sampling_clip_min: tis raises rho to floor, mask drops rho < floor). Off the completion mask weights are 0 and nothing is
    rejected. `ratio` reports the unbounded rho (for statistics).
    """
    mode = RolloutCorrection(mode)
    if cap <= 0:
        raise ValueError(f"cap must be > 0, got {cap}")
    if floor is not None and not 0 <= floor < cap:
        raise ValueError(f"floor must lie in [0, cap={cap}), got {floor}")
    on = mask != 0  # [N, T]
    log_rho = sampler_log_ratio(old_logprobs, sampler_logprobs, mask)  # [N, T]
    if mode is RolloutCorrection.NONE:
        ratio = torch.exp(log_rho.clamp(-_LOG_RHO_CLAMP, _LOG_RHO_CLAMP))  # [N, T]
        return CorrectionWeights(on.float(), torch.zeros_like(on), torch.where(on, ratio, 0.0))
    level = _LEVELS[mode](log_rho, mask).clamp(-_LOG_RHO_CLAMP, _LOG_RHO_CLAMP)  # [N, T]
    ratio = torch.exp(level)  # [N, T]
    weights, rejected = _BOUNDS[mode](ratio, cap, floor)  # [N, T], [N, T]
    zero = torch.zeros_like(weights)
    return CorrectionWeights(
        weights=torch.where(on, weights, zero),
        rejected=rejected & on,
        ratio=torch.where(on, ratio, zero),
    )


class MismatchStats(NamedTuple):
    """Sums and maxima over completion tokens (the caller divides by `tokens` across micro-batches)."""

    abs_diff_sum: torch.Tensor  # [] sum of |log pi_old - log pi_sampler|
    abs_diff_max: torch.Tensor  # [] its maximum
    ratio_sum: torch.Tensor  # [] sum of rho_s at the mode's level
    ratio_max: torch.Tensor  # []
    rejected: torch.Tensor  # [] tokens with weight 0 from a mask mode
    tokens: torch.Tensor  # [] completion tokens


def mismatch_stats(
    old_logprobs: torch.Tensor,
    sampler_logprobs: torch.Tensor,
    mask: torch.Tensor,
    correction: CorrectionWeights,
) -> MismatchStats:
    """The sampler/trainer mismatch of one batch: |log-prob difference| and the importance ratio. [N, T]."""
    on = mask != 0  # [N, T]
    diff = sampler_log_ratio(old_logprobs, sampler_logprobs, mask).abs()  # [N, T], 0 off the mask
    zero = diff.new_zeros(())
    return MismatchStats(
        abs_diff_sum=diff.sum(),
        abs_diff_max=diff.max() if diff.numel() else zero,
        ratio_sum=correction.ratio.sum(),
        ratio_max=correction.ratio.max() if diff.numel() else zero,
        rejected=correction.rejected.sum().float(),
        tokens=on.sum().float(),
    )
