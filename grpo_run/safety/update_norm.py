"""How far an optimizer step moved the trainable parameters: |theta_after - theta_before|, exactly.

An update with a non-zero gradient that leaves every trainable parameter as it was trains nothing (an
optimizer whose lr is 0, an optimizer holding tensors the forward pass never reads, updates below the
weights' precision); `alerts/weights_unchanged` (tracking/alarms.py) says so from this norm.

Why a copy, and of what. The optimizers are opaque (torch's AdamW, fused or foreach, and DeepSpeed's
ZeRO-2 step, which updates float32 master partitions and then copies them into the module's weights): no
hook sees a parameter just before and just after its own update, and a checksum or a few sampled tensors
could not prove that nothing moved. So each rank copies its share of the trainable parameters, as the
forward pass reads them, right before `engine.step()` (after the backward pass has freed its
activations) and frees the copy right after. The shares are disjoint and together cover every trainable
tensor: under ZeRO-1/2 every rank holds the same full weights after the step, so rank r copies tensors
r, r + W, r + 2W, ... and the squared norms are summed over the ranks in the step's one reduction. The
cost: 1/W of the trainable weights in their own dtype (LoRA: the adapters only, a few MB), one pass over
them, no host sync (`plan` counts it as `update_snapshot`).

Exact: the difference is taken in the parameters' own dtype, where a - b == 0 only when a == b, and the
norm is taken of the difference divided by its largest element, so no float32 sum of squares underflows
a real change to 0 or overflows.
"""

import torch

from grpo_run.engine.base import Engine

Snapshot = list[tuple[torch.Tensor, torch.Tensor]]  # (parameter, its value before the step)


def snapshot(engine: Engine) -> Snapshot:
    """This rank's share of the trainable parameters and a copy of each."""
    trainable = [p for p in engine.module.parameters() if p.requires_grad]
    return [(p, p.detach().clone()) for p in trainable[engine.rank :: engine.world_size]]


@torch.no_grad()
def moved_squared(before: Snapshot, device: torch.device) -> torch.Tensor:
    """Sum over the snapshot's parameters of |theta_now - theta_before|^2, float64 on `device`; the copies
    are overwritten (they are not needed after this)."""
    total = torch.zeros((), dtype=torch.float64, device=device)
    for param, old in before:
        diff = old.sub_(param)  # [same shape] 0 exactly where the parameter did not move
        top = torch.linalg.vector_norm(diff, ord=float("inf"))  # [] the largest change
        diff.div_(torch.where(top > 0, top, torch.ones_like(top)))  # every entry in [-1, 1]
        norm = top.double() * torch.linalg.vector_norm(diff, dtype=torch.float32).double()  # []
        total = total + norm.square().to(device)
    return total
