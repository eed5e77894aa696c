"""The weights generation samples from: the policy itself, or a bfloat16 copy of it.

A policy kept in float32 and run under bf16 autocast pays, at every decode step, a cast of each
activation before each matmul and float32 element-wise work on the residual stream. Decoding from a
bf16 copy of the weights skips both. It is what verl and OpenRLHF do with a bf16 inference engine:
the copy only samples; log-probs, the loss and the gradient still come from the float32 policy under
autocast, so the samples come from the same weights rounded to bf16, exactly as autocast rounds them
for its matmuls.
The copy is rebuilt from the policy before each generation and freed after it, so the update runs
without it in memory (2 bytes a parameter: 270 MB for a 135M-parameter model).
"""

import copy

import torch


class SamplingWeights:
    """`model()` is what generation and evaluation run. `mark_stale()` after the policy's weights change;
    `release()` after sampling, so that the copy's memory is not held through the update."""

    def __init__(self, policy: torch.nn.Module, *, bf16_copy: bool) -> None:
        self.policy = policy
        self.copy: torch.nn.Module | None = None
        if bf16_copy:
            self.copy = copy.deepcopy(policy).to(torch.bfloat16).eval().requires_grad_(False)
        # Empty until first used: weights restored from a checkpoint come after this.
        self.release()
        self._stale = True

    @property
    def is_copy(self) -> bool:
        return self.copy is not None

    def mark_stale(self) -> None:
        self._stale = True

    @torch.no_grad()
    def model(self) -> torch.nn.Module:
        if self.copy is None:
            return self.policy
        if self._stale:
            source = dict(self.policy.named_parameters())
            for name, param in self.copy.named_parameters():  # tied weights are one parameter here too
                param.data = source[name].detach().to(torch.bfloat16)  # round to nearest even, like autocast
            self._stale = False
        return self.copy

    def release(self) -> None:
        """Free the copy's weights (they are rebuilt from the policy at the next `model()`): the update,
        which changes the policy anyway, runs without them in memory."""
        if self.copy is None:
            return
        for param in self.copy.parameters():
            param.data = torch.empty(0, dtype=torch.bfloat16, device=param.device)
        self._stale = True


def wants_bf16_copy(*, autocast_bf16: bool, weight_dtype: torch.dtype, enabled: bool) -> bool:
    """A copy helps only when float32 weights run under bf16 autocast (bf16 weights are used as they are)."""
    return enabled and autocast_bf16 and weight_dtype == torch.float32
