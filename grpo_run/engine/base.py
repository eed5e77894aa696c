"""The engine interface the trainer sees: forward module, backward, optimizer step, reductions."""

from pathlib import Path
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
        """Clip, apply the optimizer and LR schedule, zero the grads; return the pre-clip grad norm.

        When the grad norm is not finite the update is skipped on every rank: grads zeroed, weights,
        optimizer state and LR schedule untouched, and the returned norm is non-finite (the trainer
        counts it in train/skipped_steps)."""

    def current_lr(self) -> float:
        """The learning rate the next `step` applies."""

    def set_base_lr(self, lr: float) -> None:
        """Make `lr` the LR schedule's base lr, keeping the schedule's position (a resume applies the
        configured lr over the checkpoint's)."""

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over ranks (identity with one process)."""

    def all_reduce_max(self, tensor: torch.Tensor) -> torch.Tensor:
        """Max over ranks (identity with one process)."""

    def save_state(self, path: Path) -> None:
        """Write model weights, optimizer and LR scheduler to the folder `path` (every rank calls it)."""

    def load_state(self, path: Path) -> None:
        """Restore what `save_state(path)` wrote (every rank calls it)."""

    def barrier(self) -> None:
        """Wait until every rank reaches this point (no-op with one process)."""

    def broadcast_flag(self, flag: bool) -> bool:
        """True on every rank when any rank's flag is True (an all-reduce MAX)."""

    def scatter_objects(self, objects: list | None) -> object:
        """Rank r gets objects[r] of the main rank's list (picklable; other ranks pass None)."""
