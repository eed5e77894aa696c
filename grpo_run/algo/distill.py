"""On-policy distillation: a teacher scores the student's own sampled tokens (docs/algorithm.md).

Shapes: N completions, T completion positions. `logprobs` is log pi_student and `teacher_logprobs`
log pi_teacher of the same sampled token at each position, both [N, T]; `mask` [N, T] holds the loss
tokens (the model's own tokens: prompt, padding and a multi-turn episode's observation tokens are 0).
Only the sampled token's log-prob is compared, so the two models' vocabularies may differ in padding.
Values off the mask never reach a result.

Two forms (`DistillForm`):
- advantage: A_t = reward_weight * A_i - coef * sum_{s >= t} discount^k(s) (log pi_s - log pi_teacher_s),
  the sum over the completion's loss tokens from t on, k(s) counting the loss tokens between t and s
  (discount 0: the token's own term only). The policy-gradient loss then pushes each token by it.
- loss: coef * the aggregated reverse-KL estimate KL(pi_student || pi_teacher) (k1 or k3, `algo/kl.py`)
  added to the loss, with the group-relative advantage scaled by reward_weight.
"""

import torch

from grpo_run.algo.enums import Aggregation, KLEstimator
from grpo_run.algo.kl import kl_divergence
from grpo_run.algo.losses import aggregate

# The estimators distill.form=loss offers (verl's loss_mode k1 / k3).
LOSS_ESTIMATORS = (KLEstimator.K1, KLEstimator.K3)


def teacher_log_ratio(
    logprobs: torch.Tensor, teacher_logprobs: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """log pi_student - log pi_teacher of each loss token, 0 off the mask. [N, T] -> [N, T]."""
    on = mask != 0  # [N, T]
    return torch.where(on, logprobs - teacher_logprobs, torch.zeros_like(logprobs))  # [N, T]


def discounted_future_sum(x: torch.Tensor, mask: torch.Tensor, discount: float) -> torch.Tensor:
    """S_t = x_t + discount * S_next on loss tokens, S_next the value at the next loss token (0 past the
    last); 0 off the mask. Observation tokens between two model turns are skipped, not discounted.
    x, mask: [N, T] -> [N, T]."""
    on = mask != 0  # [N, T]
    x = torch.where(on, x, torch.zeros_like(x))  # [N, T]
    if discount == 0:
        return x
    out = torch.zeros_like(x)  # [N, T]
    running = torch.zeros_like(x[:, 0])  # [N] the sum from the next loss token on
    for t in range(x.size(1) - 1, -1, -1):
        running = torch.where(on[:, t], x[:, t] + discount * running, running)  # [N]
        out[:, t] = torch.where(on[:, t], running, torch.zeros_like(running))
    return out


def distill_advantages(
    advantages: torch.Tensor,
    logprobs: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    coef: float,
    discount: float,
    reward_weight: float,
) -> torch.Tensor:
    """Per-token advantages [N, T] of distill.form=advantage: reward_weight times the group-relative
    advantage `advantages` [N] broadcast over the row, minus coef times the discounted sum of the teacher
    log-ratios from each token on (module docstring); 0 off the mask. `logprobs` are the student's
    without gradient (the advantage is a constant of the loss)."""
    ratio = teacher_log_ratio(logprobs.detach(), teacher_logprobs, mask)  # [N, T]
    teacher_term = -coef * discounted_future_sum(ratio, mask, discount)  # [N, T]
    task_term = reward_weight * advantages.to(ratio.dtype).unsqueeze(-1)  # [N, 1]
    on = mask != 0  # [N, T]
    return torch.where(on, task_term + teacher_term, torch.zeros_like(teacher_term))  # [N, T]


def teacher_kl_sum(
    logprobs: torch.Tensor, teacher_logprobs: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum over loss tokens of log pi_student - log pi_teacher, the number of loss tokens): the metric
    distill/teacher_kl is their ratio over the step. [N, T] -> ([], [])."""
    ratio = teacher_log_ratio(logprobs.detach(), teacher_logprobs, mask)  # [N, T]
    return ratio.sum(), (mask != 0).sum().to(ratio.dtype)


def distill_loss(
    logprobs: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    estimator: KLEstimator | str,
    aggregation: Aggregation | str,
    normalizer: torch.Tensor | float | None = None,
    constant_length: float | None = None,
) -> torch.Tensor:
    """distill.form=loss's term before its coefficient: the per-token estimate of KL(pi_student ||
    pi_teacher) (k1 = log pi - log pi_teacher, k3 = exp(d) - d - 1 with d = log pi_teacher - log pi),
    aggregated like the policy loss (`aggregate`, the step's `normalizer`). Gradient through `logprobs`
    only. [N, T] -> []."""
    if KLEstimator(estimator) not in LOSS_ESTIMATORS:
        raise ValueError(f"distillation's loss estimator must be k1 or k3, got {estimator}")
    on = mask != 0  # [N, T]
    # Both sides zeroed off the mask: d = 0 there, so padding never reaches a gradient.
    safe = torch.where(on, logprobs, torch.zeros_like(logprobs))  # [N, T]
    teacher = teacher_logprobs.detach().to(logprobs.dtype)  # [N, T] a constant of the loss
    safe_teacher = torch.where(on, teacher, torch.zeros_like(logprobs))  # [N, T]
    kl = kl_divergence(safe, safe_teacher, estimator)  # [N, T]
    return aggregate(kl, mask, aggregation, normalizer=normalizer, constant_length=constant_length)  # []
