"""Adaptive KL coefficient (PPO, Ziegler et al. 2019): steer beta so the observed KL tracks a target."""

import torch

PROPORTIONAL_ERROR_CLIP = 0.2  # Ziegler et al.: the relative error is clipped to [-0.2, 0.2]


def adaptive_beta(
    beta: torch.Tensor | float,
    observed_kl: torch.Tensor | float,
    *,
    target: float,
    horizon: float,
    n_steps: int,
) -> torch.Tensor | float:
    """New beta = beta * (1 + clip(observed_kl / target - 1, -0.2, 0.2) * n_steps / horizon).

    KL above target -> beta grows; below -> beta shrinks. Scalars (float or 0-dim tensor) in; a
    tensor comes back when either input is a tensor, a float when both are floats (no host sync).
    """
    error = observed_kl / target - 1.0
    if isinstance(error, torch.Tensor):
        error = error.clamp(-PROPORTIONAL_ERROR_CLIP, PROPORTIONAL_ERROR_CLIP)
    else:
        error = min(max(error, -PROPORTIONAL_ERROR_CLIP), PROPORTIONAL_ERROR_CLIP)
    return beta * (1.0 + error * n_steps / horizon)
