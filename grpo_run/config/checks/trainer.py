"""trainer: the step's batch, the optimizer, the device."""

import math

from grpo_run.config.checks.base import check, fail
from grpo_run.config.schema import Config, DistributedKind


def validate_batch(cfg: Config) -> None:
    """Steps, prompts per step and micro-batches: the step's completions split into whole micro-batches."""
    t, g = cfg.trainer, cfg.grpo
    check(t.max_steps >= 1, "trainer.max_steps", t.max_steps, "must be >= 1")
    check(t.prompts_per_step >= 1, "trainer.prompts_per_step", t.prompts_per_step, "must be >= 1")
    check(t.micro_batch_size >= 1, "trainer.micro_batch_size", t.micro_batch_size, "must be >= 1")
    completions = t.prompts_per_step * g.group_size
    if completions % t.micro_batch_size:
        fail(
            "trainer.micro_batch_size",
            t.micro_batch_size,
            f"must divide trainer.prompts_per_step * grpo.group_size = "
            f"{t.prompts_per_step} * {g.group_size} = {completions} completions per step",
        )


def validate_packing(cfg: Config) -> None:
    """trainer.padding_free and trainer.micro_batch_tokens: a positive budget; packing on one rank only
    (ZeRO-2 reduces gradients inside every backward, so every rank must run as many micro-batches, which a
    token budget does not guarantee)."""
    t, d = cfg.trainer, cfg.distributed
    if t.micro_batch_tokens is not None:
        check(t.micro_batch_tokens >= 1, "trainer.micro_batch_tokens", t.micro_batch_tokens, "must be >= 1")
    ranks = d.nproc_per_node * d.nnodes if d.kind == DistributedKind.DEEPSPEED else 1
    if t.padding_free and ranks > 1:
        fail(
            "trainer.padding_free",
            t.padding_free,
            f"packed micro-batches run on one rank only ({ranks} ranks: distributed.nproc_per_node x "
            "distributed.nnodes); use trainer.padding_free=false or null",
        )


def validate_optimizer(cfg: Config) -> None:
    t = cfg.trainer
    check(t.lr > 0 and math.isfinite(t.lr), "trainer.lr", t.lr, "must be a finite number > 0")
    check(t.warmup_steps >= 0, "trainer.warmup_steps", t.warmup_steps, "must be >= 0")
    check(t.max_grad_norm > 0, "trainer.max_grad_norm", t.max_grad_norm, "must be > 0")


def validate_device(cfg: Config) -> None:
    t = cfg.trainer
    check(t.device in ("auto", "cpu", "cuda"), "trainer.device", t.device, "must be auto, cpu or cuda")
    if t.device == "cuda":
        validate_cuda(t.device)


def validate_cuda(device: str) -> None:
    """trainer.device=cuda on a machine where torch sees no GPU: a config error now, not a crash later."""
    import torch  # only for this key: the rest of validation stays light

    if not torch.cuda.is_available():
        built = (
            f"torch {torch.__version__}, built with CUDA {torch.version.cuda}"
            if torch.version.cuda
            else f"torch {torch.__version__}, a CPU-only build"
        )
        fail(
            "trainer.device",
            device,
            f"torch sees no CUDA device ({built}; torch.cuda.device_count()={torch.cuda.device_count()}); "
            "use trainer.device=cpu or auto",
        )
