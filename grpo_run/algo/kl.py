"""Per-token estimators of KL(pi_theta || pi_ref) on tokens sampled from the policy (Schulman, k1/k2/k3).

All take log-probs of the sampled tokens, `logprobs` (policy) and `ref_logprobs` (reference), both
[N, T], and return [N, T]. With d = log pi_ref - log pi_theta:
k1 = -d, k2 = d^2 / 2, k3 = exp(d) - d - 1.
"""

from collections.abc import Callable

import torch

from grpo_run.algo.enums import KLEstimator

# exp(20) ~ 4.9e8: far beyond any useful ratio, yet small enough that exp stays finite in fp32 and
# the loss never turns inf/NaN on one pathological token. Outside the band k3's gradient is zero.
K3_LOG_RATIO_CLAMP = 20.0


def kl_k1(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k1 = log pi_theta - log pi_ref, [N, T]. Unbiased, but negative on some tokens."""
    return logprobs - ref_logprobs  # [N, T]


def kl_k2(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k2 = (log pi_ref - log pi_theta)^2 / 2, [N, T]. Biased, always >= 0."""
    d = ref_logprobs - logprobs  # [N, T]
    return 0.5 * d * d  # [N, T]


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k3 = exp(d) - d - 1 with d = log pi_ref - log pi_theta, [N, T]. Unbiased, always >= 0.

    d is clamped to [-20, 20] before use (see K3_LOG_RATIO_CLAMP) for numerical safety.
    """
    d = (ref_logprobs - logprobs).clamp(-K3_LOG_RATIO_CLAMP, K3_LOG_RATIO_CLAMP)  # [N, T]
    return torch.exp(d) - d - 1.0  # [N, T]


KLFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

KL_ESTIMATORS: dict[KLEstimator, KLFn] = {
    KLEstimator.K1: kl_k1,
    KLEstimator.K2: kl_k2,
    KLEstimator.K3: kl_k3,
}


def kl_divergence(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: KLEstimator | str
) -> torch.Tensor:
    """Per-token KL estimate [N, T] with the chosen estimator (k1 | k2 | k3)."""
    return KL_ESTIMATORS[KLEstimator(estimator)](logprobs, ref_logprobs)  # [N, T]
