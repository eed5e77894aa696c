"""Group selection for DAPO dynamic sampling: which groups of a round to keep, and stitching rounds together.

A rollout holds B·G rows (row b·G + g is completion g of prompt b); groups are kept or dropped whole.
Rounds are generated separately, so their prompt and completion widths differ: `concat_rollouts`
re-pads them (prompts on the left, completions on the right, both with mask 0) into one rollout.
"""

import torch

from grpo_run.rollout.generate import Rollout


def informative_groups(zero_std: torch.Tensor, needed: int) -> list[int]:
    """Indices of the first `needed` groups whose rewards are not all equal, in order.

    zero_std: bool [B] (see `algo.zero_std_groups`). Returns host ints: the caller must know on the
    host whether to sample another round, so this is the one place dynamic sampling syncs.
    """
    if needed <= 0:
        return []
    keep = (~zero_std).nonzero().flatten()  # [k]
    return keep[:needed].tolist()


def group_rows(groups: list[int], group_size: int) -> list[int]:
    """Rows of the given groups in a [B·G] layout: group b covers rows b·G … b·G + G − 1."""
    return [b * group_size + g for b in groups for g in range(group_size)]


def rows_with_gradient(advantages: torch.Tensor, loss_mask: torch.Tensor) -> list[int]:
    """Rows whose policy-gradient term can be non-zero: advantage ≠ 0 and at least one loss token.

    advantages [N], loss_mask [N, T]. With β = 0 and no entropy bonus every other row has loss and
    gradient exactly 0 (ratio · 0, clipped or not). Never empty: the first row is kept when no row
    qualifies, so every parameter still gets a (zero) gradient and the optimizer step is unchanged.
    One host sync.
    """
    live = (advantages != 0) & (loss_mask.sum(-1) > 0)  # [N]
    rows = live.nonzero().flatten().tolist()
    return rows or [0]


def take_rows(rollout: Rollout, rows: list[int]) -> Rollout:
    """The rollout restricted to `rows` (in that order)."""
    index = torch.tensor(rows, dtype=torch.long, device=rollout.completion_ids.device)  # [n]
    return Rollout(
        prompt_ids=rollout.prompt_ids[index],
        prompt_mask=rollout.prompt_mask[index],
        completion_ids=rollout.completion_ids[index],
        completion_mask=rollout.completion_mask[index],
        truncated=rollout.truncated[index],
        sampler_logprobs=None if rollout.sampler_logprobs is None else rollout.sampler_logprobs[index],
        trainable_mask=None if rollout.trainable_mask is None else rollout.trainable_mask[index],
        policy_version=None if rollout.policy_version is None else rollout.policy_version[index],
    )


def _pad(x: torch.Tensor, width: int, value: int, *, left: bool) -> torch.Tensor:
    missing = width - x.size(1)
    if missing == 0:
        return x
    fill = torch.full((x.size(0), missing), value, dtype=x.dtype, device=x.device)  # [n, missing]
    return torch.cat([fill, x] if left else [x, fill], dim=1)  # [n, width]


def concat_rollouts(rollouts: list[Rollout], pad_id: int) -> Rollout:
    """Rows of every rollout, in order, padded to the widest prompt (left) and completion (right)."""
    if len(rollouts) == 1:
        return rollouts[0]
    p = max(r.prompt_ids.size(1) for r in rollouts)
    t = max(r.completion_ids.size(1) for r in rollouts)
    return Rollout(
        prompt_ids=torch.cat([_pad(r.prompt_ids, p, pad_id, left=True) for r in rollouts]),  # [N, P]
        prompt_mask=torch.cat([_pad(r.prompt_mask, p, 0, left=True) for r in rollouts]),  # [N, P]
        completion_ids=torch.cat([_pad(r.completion_ids, t, pad_id, left=False) for r in rollouts]),  # [N, T]
        completion_mask=torch.cat([_pad(r.completion_mask, t, 0, left=False) for r in rollouts]),  # [N, T]
        truncated=torch.cat([r.truncated for r in rollouts]),  # [N]
        sampler_logprobs=_concat_sampler_logprobs(rollouts, t),
        trainable_mask=_concat_trainable_masks(rollouts, t),
        policy_version=_concat_versions(rollouts),
    )


def _concat_sampler_logprobs(rollouts: list[Rollout], width: int) -> torch.Tensor | None:
    if any(r.sampler_logprobs is None for r in rollouts):
        return None
    return torch.cat([_pad(r.sampler_logprobs, width, 0, left=False) for r in rollouts])  # [N, T]


def _concat_trainable_masks(rollouts: list[Rollout], width: int) -> torch.Tensor | None:
    """None when no round has observation tokens; otherwise a round without a mask is all the model's."""
    if all(r.trainable_mask is None for r in rollouts):
        return None
    masks = [r.completion_mask if r.trainable_mask is None else r.trainable_mask for r in rollouts]
    return torch.cat([_pad(m, width, 0, left=False) for m in masks])  # [N, T]


def _concat_versions(rollouts: list[Rollout]) -> torch.Tensor | None:
    if any(r.policy_version is None for r in rollouts):
        return None
    return torch.cat([r.policy_version for r in rollouts])  # [N]


def loss_mask(rollout: Rollout, mask_truncated: bool) -> torch.Tensor:
    """Float [N, T]: the model's tokens (completion mask x trainable mask: observation tokens of a
    multi-turn episode never enter the loss), with truncated completions zeroed when `mask_truncated`.

    DAPO's overlong filtering: a completion cut off at max_new_tokens has no ending to judge, so its
    reward is noise for the loss; it still counts in its group's reward statistics.
    """
    mask = rollout.model_mask.float()  # [N, T]
    if not mask_truncated:
        return mask
    return mask * (~rollout.truncated).unsqueeze(-1).to(mask.dtype)  # [N, T]
