"""Group-relative advantages: rewards of each prompt's G completions -> one advantage per completion.

Every mode shares one signature and sits in `ADVANTAGE_FUNCTIONS`. Invalid members (a completion the
reward could not score) are left out of every statistic and get advantage exactly 0. A group whose
valid rewards are all equal (this includes a group with fewer than two valid members) carries no
learning signal and gets exactly 0 in every mode but raw.
"""

from collections.abc import Callable
from typing import NamedTuple

import torch

from grpo_run.algo.enums import AdvantageMode, StdCorrection


class GroupStats(NamedTuple):
    """Per-group statistics over the valid members only."""

    mean: torch.Tensor  # [B] mean of the valid rewards (0 for a group with none)
    std: torch.Tensor  # [B] std of the valid rewards with the requested correction
    count: torch.Tensor  # [B] number of valid members (int64)
    zero_std: torch.Tensor  # [B] bool: all valid rewards equal (true too for 0 or 1 valid members)


def _valid_mask(rewards: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    if valid is None:
        return torch.ones_like(rewards, dtype=torch.bool)  # [B, G]
    return valid.to(torch.bool)  # [B, G]


def _as_float(rewards: torch.Tensor) -> torch.Tensor:
    return rewards if rewards.is_floating_point() else rewards.to(torch.float32)


def _std(
    clean: torch.Tensor,
    valid: torch.Tensor,
    mean: torch.Tensor,
    count: torch.Tensor,
    correction: StdCorrection,
) -> torch.Tensor:
    """Std of `clean` over `valid` along the last dim; `mean`/`count` have that dim already reduced."""
    sq_dev = torch.where(valid, (clean - mean.unsqueeze(-1)) ** 2, 0.0)  # [..., G]
    denom = count if correction is StdCorrection.POPULATION else count - 1  # [...]
    return torch.sqrt(sq_dev.sum(-1) / denom.clamp(min=1))  # [...]


def group_stats(
    rewards: torch.Tensor,
    valid: torch.Tensor | None = None,
    *,
    std_correction: StdCorrection | str = StdCorrection.POPULATION,
) -> GroupStats:
    """Mean, std, valid count and the zero-std flag of each group.

    rewards: [B, G]; valid: optional bool [B, G]. Returns a `GroupStats` of [B] tensors.
    `zero_std` compares max and min exactly, so it never depends on float rounding of the mean;
    it feeds `train/frac_reward_zero_std`.
    """
    correction = StdCorrection(std_correction)
    rewards = _as_float(rewards)
    valid = _valid_mask(rewards, valid)  # [B, G]
    clean = torch.where(valid, rewards, 0.0)  # [B, G] placeholders (even NaN) never reach the sums
    count = valid.sum(-1)  # [B]
    mean = clean.sum(-1) / count.clamp(min=1)  # [B]
    std = _std(clean, valid, mean, count, correction)  # [B]
    hi = torch.where(valid, rewards, -torch.inf).amax(-1)  # [B]
    lo = torch.where(valid, rewards, torch.inf).amin(-1)  # [B]
    zero_std = (hi == lo) | (count < 2)  # [B]
    return GroupStats(mean=mean, std=std, count=count, zero_std=zero_std)


def zero_std_groups(rewards: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """Bool [B]: groups whose valid rewards are all equal (no learning signal). rewards: [B, G]."""
    return group_stats(rewards, valid).zero_std


# One signature for every mode: (clean rewards [B, G], valid [B, G], stats, correction, eps) -> [B, G].
# Entries are masked afterwards by `compute_advantages`, so they need not care about invalid members.
AdvantageFn = Callable[[torch.Tensor, torch.Tensor, GroupStats, StdCorrection, float], torch.Tensor]


def _raw(clean, valid, stats, correction, eps):
    return clean  # [B, G]


def _centered(clean, valid, stats, correction, eps):
    return clean - stats.mean.unsqueeze(-1)  # [B, G]


def _normalized(clean, valid, stats, correction, eps):
    return (clean - stats.mean.unsqueeze(-1)) / (stats.std.unsqueeze(-1) + eps)  # [B, G]


def _rloo(clean, valid, stats, correction, eps):
    # Baseline of member i = mean of the other n - 1 valid members = (sum - r_i) / (n - 1).
    total = clean.sum(-1, keepdim=True)  # [B, 1]
    others = (stats.count - 1).clamp(min=1).unsqueeze(-1)  # [B, 1]
    return clean - (total - clean) / others  # [B, G]


def _normalized_batch(clean, valid, stats, correction, eps):
    # The std is taken once over every valid reward of the step (all groups), not per group.
    flat_valid = valid.reshape(-1)  # [B*G]
    flat = clean.reshape(-1)  # [B*G]
    count = flat_valid.sum()  # []
    mean = flat.sum() / count.clamp(min=1)  # []
    batch_std = _std(flat, flat_valid, mean, count, correction)  # []
    return (clean - stats.mean.unsqueeze(-1)) / (batch_std + eps)  # [B, G]


ADVANTAGE_FUNCTIONS: dict[AdvantageMode, AdvantageFn] = {
    AdvantageMode.RAW: _raw,
    AdvantageMode.CENTERED: _centered,
    AdvantageMode.NORMALIZED: _normalized,
    AdvantageMode.RLOO: _rloo,
    AdvantageMode.NORMALIZED_BATCH: _normalized_batch,
}


def compute_advantages(
    rewards: torch.Tensor,
    mode: AdvantageMode | str,
    std_correction: StdCorrection | str,
    eps: float,
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """Advantages [B, G] from rewards [B, G] (one row per prompt, one column per completion).

    mode: normalized (r - mu)/(sigma + eps) | centered r - mu | raw r | rloo r_i - mean(others) |
    normalized_batch (r - mu_group)/(sigma_step + eps), sigma_step over every valid reward passed in
    (pass the whole step's rewards). std_correction: population divides by n, sample by n - 1, with n
    the number of valid members. valid: optional bool [B, G]; invalid entries are excluded from the
    statistics and get exactly 0. Zero-std groups get exactly 0 except in raw mode.
    """
    mode = AdvantageMode(mode)
    correction = StdCorrection(std_correction)
    rewards = _as_float(rewards)
    valid = _valid_mask(rewards, valid)  # [B, G]
    clean = torch.where(valid, rewards, 0.0)  # [B, G]
    stats = group_stats(clean, valid, std_correction=correction)
    adv = ADVANTAGE_FUNCTIONS[mode](clean, valid, stats, correction, eps)  # [B, G]
    keep = valid if mode is AdvantageMode.RAW else valid & ~stats.zero_std.unsqueeze(-1)  # [B, G]
    return torch.where(keep, adv, 0.0)  # [B, G]


def normalize_then_sum(
    rewards: torch.Tensor,
    weights: torch.Tensor,
    std_correction: StdCorrection | str,
    eps: float,
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """GDPO's advantages [B, G] from per-function rewards [B, G, K] and their weights [K].

    Each function k is normalised in its group, (r_k - mu_k) / (sigma_k + eps); the weighted sum over
    k is then normalised over every valid completion passed in, (s - mean) / (std + eps). Both stds
    use `std_correction`. Invalid members (valid [B, G] false) are left out of every statistic and get
    0; a function whose rewards in a group are all equal adds 0 there (also at eps = 0), and a group in
    which every function is so gets exactly 0.
    """
    correction = StdCorrection(std_correction)
    rewards = _as_float(rewards)  # [B, G, K]
    valid = _valid_mask(rewards[..., 0], valid)  # [B, G]
    per_fn_valid = valid.unsqueeze(-1).expand_as(rewards)  # [B, G, K]
    clean = torch.where(per_fn_valid, rewards, 0.0)  # [B, G, K]
    # Statistics along G: move K before G so `_std` reduces the last dim.
    by_fn = clean.transpose(-1, -2)  # [B, K, G]
    by_fn_valid = per_fn_valid.transpose(-1, -2)  # [B, K, G]
    count = by_fn_valid.sum(-1)  # [B, K]
    mean = by_fn.sum(-1) / count.clamp(min=1)  # [B, K]
    std = _std(by_fn, by_fn_valid, mean, count, correction)  # [B, K]
    hi = torch.where(by_fn_valid, by_fn, -torch.inf).amax(-1)  # [B, K]
    lo = torch.where(by_fn_valid, by_fn, torch.inf).amin(-1)  # [B, K]
    flat = (hi == lo) | (count < 2)  # [B, K] a function with no spread in the group adds 0 (even at eps 0)
    normalised = (by_fn - mean.unsqueeze(-1)) / (std.unsqueeze(-1) + eps)  # [B, K, G]
    normalised = torch.where(flat.unsqueeze(-1), 0.0, normalised)  # [B, K, G]
    summed = (normalised * weights.to(normalised.dtype).view(1, -1, 1)).sum(-2)  # [B, G]
    flat_sums, flat_valid = summed.reshape(-1), valid.reshape(-1)  # [B*G]
    n = flat_valid.sum()  # []
    batch_mean = torch.where(flat_valid, flat_sums, 0.0).sum() / n.clamp(min=1)  # []
    batch_std = _std(flat_sums, flat_valid, batch_mean, n, correction)  # []
    adv = (summed - batch_mean) / (batch_std + eps)  # [B, G]
    keep = valid & ~flat.all(-1).unsqueeze(-1)  # [B, G] every function flat: the group has no signal
    return torch.where(keep, adv, 0.0)  # [B, G]
