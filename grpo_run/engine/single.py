"""One process, plain PyTorch: AdamW, gradient clipping, the LR schedule of grpo_run/engine/schedule.py."""

from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, load_model, save_file, save_model

from grpo_run.engine.schedule import set_base_lr

# File names inside a checkpoint folder (see grpo_run/checkpoint/ for the rest of the folder).
WEIGHTS_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
SCHEDULER_FILE = "scheduler.pt"
# A weights file holding only the trainable parameters (LoRA: the adapters; the frozen base weights are
# the model's own files) says so in its safetensors metadata.
TRAINABLE_ONLY = "grpo_run.trainable_only"


def save_weights(model: torch.nn.Module, file: Path) -> None:
    """Every weight when all train; otherwise only the trainable ones (the frozen ones never change)."""
    params = dict(model.named_parameters())
    trainable = {name: p.detach().contiguous() for name, p in params.items() if p.requires_grad}
    if len(trainable) == len(params):
        # save_model handles the tied embedding/LM-head weights that safetensors' save_file refuses.
        save_model(model, str(file))
    else:
        save_file(trainable, str(file), metadata={TRAINABLE_ONLY: "1"})


def load_weights(model: torch.nn.Module, file: Path, device: torch.device) -> None:
    """What `save_weights` wrote; strict: a name missing from the file, or one the model lacks, raises."""
    with safe_open(str(file), framework="pt") as f:
        trainable_only = (f.metadata() or {}).get(TRAINABLE_ONLY) == "1"
    if not trainable_only:
        load_model(model, str(file), strict=True, device=str(device))
        return
    tensors = load_file(str(file), device=str(device))
    wanted = {name: p for name, p in model.named_parameters() if p.requires_grad}
    if set(tensors) != set(wanted):
        missing, unexpected = sorted(set(wanted) - set(tensors)), sorted(set(tensors) - set(wanted))
        raise RuntimeError(
            f"{file}: trainable weights do not match (missing {missing}, unexpected {unexpected})"
        )
    with torch.no_grad():
        for name, param in wanted.items():
            param.copy_(tensors[name])


def adamw_with_schedule(
    model: torch.nn.Module,
    *,
    lr: float,
    weight_decay: float,
    betas: tuple[float, float],
    lr_factor: Callable[[int], float],
    fused: bool,
) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """torch's AdamW over the trainable parameters and the LR schedule (both engines use these).

    fused: one kernel per parameter instead of a dozen element-wise ops, each a pass over the
    parameter and its moments (the same update up to float rounding)."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=betas, fused=fused or None)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)


class SingleProcessEngine:
    rank = 0
    world_size = 1

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        lr: float,
        weight_decay: float,
        betas: tuple[float, float],
        lr_factor: Callable[[int], float],
        max_grad_norm: float,
        device: torch.device,
        fused_adamw: bool = False,
    ) -> None:
        self.device = device
        self._model = model
        self.max_grad_norm = max_grad_norm
        self.optimizer, self.scheduler = adamw_with_schedule(
            model, lr=lr, weight_decay=weight_decay, betas=betas, lr_factor=lr_factor, fused=fused_adamw
        )

    @property
    def module(self) -> torch.nn.Module:
        return self._model

    @property
    def is_main(self) -> bool:
        return True

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self) -> torch.Tensor:
        params = [p for p in self._model.parameters() if p.requires_grad]
        grad_norm = torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm)
        # A non-finite norm means a NaN/inf gradient: skip the update so the weights and Adam's moments
        # stay finite (the LR schedule does not advance either). One host check per optimizer step.
        if torch.isfinite(grad_norm):
            self.optimizer.step()
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm.detach()

    def current_lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]  # what the scheduler's last step set

    def set_base_lr(self, lr: float) -> None:
        set_base_lr(self.scheduler, lr)

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def all_reduce_max(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def save_state(self, path: Path) -> None:
        save_weights(self._model, path / WEIGHTS_FILE)
        torch.save(self.optimizer.state_dict(), path / OPTIMIZER_FILE)
        torch.save(self.scheduler.state_dict(), path / SCHEDULER_FILE)

    def load_state(self, path: Path) -> None:
        load_weights(self._model, path / WEIGHTS_FILE, self.device)
        # weights_only: tensors and plain containers only, never arbitrary pickled objects.
        self.optimizer.load_state_dict(torch.load(path / OPTIMIZER_FILE, weights_only=True))
        self.scheduler.load_state_dict(torch.load(path / SCHEDULER_FILE, weights_only=True))

    def barrier(self) -> None:
        return None

    def broadcast_flag(self, flag: bool) -> bool:
        return flag

    def scatter_objects(self, objects: list | None) -> object:
        assert objects is not None and len(objects) == 1
        return objects[0]
