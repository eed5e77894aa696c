"""Building the gradient engine of a run: joining the ranks first, then one engine per `distributed.kind`."""

import atexit
from collections.abc import Callable
from dataclasses import replace

import torch
from transformers import PreTrainedModel

from grpo_run.config.run_dir import give_up_claim
from grpo_run.config.schema import Config, DistributedKind
from grpo_run.engine.base import Engine
from grpo_run.engine.schedule import lr_factor
from grpo_run.engine.single import SingleProcessEngine


def join_ranks(cfg: Config, device: torch.device) -> tuple[Config, torch.device]:
    """DeepSpeed: join the process group first; each GPU rank then trains on its own device, and every
    rank writes to rank 0's run dir (a rank's own, claimed before it knew rank 0's, is removed)."""
    if cfg.distributed.kind != DistributedKind.DEEPSPEED:
        return cfg, device
    from grpo_run.engine.launch import init_process_group, rank0_run_dir, shutdown

    d = cfg.distributed
    layout = init_process_group(device.type, d.master_addr, d.master_port, d.timeout_s)
    atexit.register(shutdown)
    shared = rank0_run_dir(cfg.run_dir)
    if shared != cfg.run_dir:
        give_up_claim(cfg.run_dir)
        cfg = replace(cfg, run_dir=shared)
    return cfg, torch.device("cuda", layout.local_rank) if device.type == "cuda" else device


def learning_rate(cfg: Config) -> float:
    """The optimizer's learning rate: `lora.lr` for LoRA adapters when set, else `trainer.lr`."""
    if cfg.lora.enabled and cfg.lora.lr is not None:
        return cfg.lora.lr
    return cfg.trainer.lr


def single_engine(cfg: Config, policy: PreTrainedModel, device: torch.device) -> Engine:
    t = cfg.trainer
    return SingleProcessEngine(
        policy,
        lr=learning_rate(cfg),
        weight_decay=t.weight_decay,
        betas=(t.adam_beta1, t.adam_beta2),
        lr_factor=lr_factor(t.lr_scheduler, warmup_steps=t.warmup_steps, max_steps=t.max_steps),
        max_grad_norm=t.max_grad_norm,
        device=device,
        fused_adamw=t.fused_adamw,
    )


def deepspeed_engine(cfg: Config, policy: PreTrainedModel, device: torch.device) -> Engine:
    from grpo_run.engine.deepspeed_engine import DeepSpeedEngine, deepspeed_config, resolve_bf16

    t, d = cfg.trainer, cfg.distributed
    ds_config = deepspeed_config(
        zero_stage=d.zero_stage,
        offload_optimizer=d.offload_optimizer,
        bf16=resolve_bf16(d.bf16, device),
        micro_batch_size=t.micro_batch_size,
        completions_per_step=t.prompts_per_step * cfg.grpo.group_size,
        world_size=d.nproc_per_node * d.nnodes,
        max_grad_norm=t.max_grad_norm,
    )
    return DeepSpeedEngine(
        policy,
        lr=learning_rate(cfg),
        weight_decay=t.weight_decay,
        betas=(t.adam_beta1, t.adam_beta2),
        lr_factor=lr_factor(t.lr_scheduler, warmup_steps=t.warmup_steps, max_steps=t.max_steps),
        ds_config=ds_config,
        device=device,
        fused_adamw=t.fused_adamw,
    )


ENGINES: dict[DistributedKind, Callable[[Config, PreTrainedModel, torch.device], Engine]] = {
    DistributedKind.SINGLE: single_engine,
    DistributedKind.DEEPSPEED: deepspeed_engine,
}


def build_engine(cfg: Config, policy: PreTrainedModel, device: torch.device) -> Engine:
    return ENGINES[cfg.distributed.kind](cfg, policy, device)
