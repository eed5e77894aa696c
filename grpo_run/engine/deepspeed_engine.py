"""Data parallelism with DeepSpeed ZeRO (stage 2 by default): one rank per process, same Engine protocol.

Our losses are already normalised to the whole step (the micro-batch losses of every rank sum to the
step loss), so DeepSpeed must neither divide by the accumulation steps nor average over ranks:
`backward(scale_wrt_gas=False)` and `gradient_allreduce_op: sum`. With `managed_gradient_accumulation:
false` our `step()` is the accumulation boundary, so the number of micro-batches per step never has to
match a counter. The optimizer is torch's AdamW (no JIT build of DeepSpeed's Adam).
"""

from collections.abc import Callable
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist

from grpo_run.engine.schedule import set_base_lr
from grpo_run.engine.single import adamw_with_schedule

# The sub-folder of a checkpoint dir that DeepSpeed's save_checkpoint fills (its "tag").
CHECKPOINT_TAG = "deepspeed"


def resolve_bf16(setting: str, device: torch.device) -> bool:
    """`distributed.bf16`: auto means on exactly when the GPU supports bf16; never on the CPU by itself."""
    value = str(setting).lower()
    if value == "auto":
        return device.type == "cuda" and torch.cuda.is_bf16_supported()
    return value == "true"


def deepspeed_config(
    *,
    zero_stage: int,
    offload_optimizer: bool,
    bf16: bool,
    micro_batch_size: int,
    completions_per_step: int,
    world_size: int,
    max_grad_norm: float,
) -> dict:
    """The DeepSpeed JSON, built from the typed config: batch sizes and clipping come from trainer.*."""
    accumulation = completions_per_step // world_size // micro_batch_size
    zero: dict = {"stage": zero_stage}
    if offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    return {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": accumulation,
        "train_batch_size": micro_batch_size * accumulation * world_size,
        "gradient_clipping": max_grad_norm,
        # Sum, not mean, over ranks and no 1/accumulation: each micro-batch loss is already a share of the step's.
        "gradient_allreduce_op": "sum",
        "managed_gradient_accumulation": False,
        "zero_optimization": zero,
        "bf16": {"enabled": bf16},
        # torch.optim.AdamW under ZeRO (and with CPU offload) instead of DeepSpeed's compiled Adam.
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 2**31 - 1,  # our tracker reports; DeepSpeed stays quiet
        "wall_clock_breakdown": False,
    }


class DeepSpeedEngine:
    def __init__(
        self,
        model: torch.nn.Module,
        *,
        lr: float,
        weight_decay: float,
        betas: tuple[float, float],
        lr_factor: Callable[[int], float],
        ds_config: dict,
        device: torch.device,
        fused_adamw: bool = False,
    ) -> None:
        self.device = device
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        optimizer, scheduler = adamw_with_schedule(
            model, lr=lr, weight_decay=weight_decay, betas=betas, lr_factor=lr_factor, fused=fused_adamw
        )
        self._scheduler = scheduler  # DeepSpeed steps this torch object itself
        self._ds, _, _, _ = deepspeed.initialize(
            model=model,
            optimizer=optimizer,
            lr_scheduler=scheduler,
            config=ds_config,
            dist_init_required=False,
        )

    @property
    def module(self) -> torch.nn.Module:
        # The wrapped model itself: ZeRO-2 reduces gradients through hooks on its parameters.
        return self._ds.module

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def backward(self, loss: torch.Tensor) -> None:
        self._ds.backward(loss, scale_wrt_gas=False)

    def step(self) -> torch.Tensor:
        self._ds.step()
        # The pre-clip norm of the summed (whole-step) gradient, the same on every rank.
        norm = self._ds.get_global_grad_norm()
        return torch.as_tensor(float(norm), dtype=torch.float32, device=self.device)

    def current_lr(self) -> float:
        return self._ds.get_lr()[0]

    def set_base_lr(self, lr: float) -> None:
        set_base_lr(self._scheduler, lr)

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        out = tensor.clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
        return out

    def all_reduce_max(self, tensor: torch.Tensor) -> torch.Tensor:
        out = tensor.clone()
        dist.all_reduce(out, op=dist.ReduceOp.MAX)
        return out

    def save_state(self, path: Path) -> None:
        # Every rank writes its optimizer partition; rank 0 also the weights and the LR scheduler.
        # The tag is named on load, so no `latest` pointer file is written beside it.
        self._ds.save_checkpoint(str(path), tag=CHECKPOINT_TAG, save_latest=False)

    def load_state(self, path: Path) -> None:
        loaded, _ = self._ds.load_checkpoint(
            str(path), tag=CHECKPOINT_TAG, load_optimizer_states=True, load_lr_scheduler_states=True
        )
        if loaded is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint in {path / CHECKPOINT_TAG}")

    def barrier(self) -> None:
        dist.barrier()

    def broadcast_flag(self, flag: bool) -> bool:
        value = torch.tensor([1.0 if flag else 0.0], device=self.device)
        return bool(self.all_reduce_max(value).item())

    def scatter_objects(self, objects: list | None) -> object:
        out: list = [None]
        dist.scatter_object_list(out, objects if self.is_main else None, src=0)
        return out[0]
