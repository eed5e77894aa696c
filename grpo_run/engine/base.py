"""The engine interface the trainer sees: forward module, backward, optimizer step, reductions."""

from typing import Protocol

import torch


class Engine(Protocol):
    rank: int
    world_size: int
    device: torch.device

    @property
    def module(self) -> torch.nn.Module:
        """The trainable policy to call for forward passes."""

    @property
    def is_main(self) -> bool:
        """Rank 0: the only one that writes files and logs."""

    def backward(self, loss: torch.Tensor) -> None:
        """Accumulate gradients of `loss` (already scaled to the step: no extra averaging here)."""

    def step(self) -> torch.Tensor:
        """Clip, apply the optimizer and LR schedule, zero the grads; return the pre-clip grad norm."""

    def current_lr(self) -> float:
        """The learning rate the next `step` applies."""

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over ranks (identity with one process)."""

    def all_reduce_max(self, tensor: torch.Tensor) -> torch.Tensor:
        """Max over ranks (identity with one process)."""
