"""rollout=async (docs/rollouts.md): its knobs, and the GPU rollout.device names."""

import re

from grpo_run.config.checks.base import check, fail
from grpo_run.config.schema import Config, RolloutMode


def validate_rollout(cfg: Config) -> None:
    """rollout=async (docs/rollouts.md): its knobs."""
    r = cfg.rollout
    if r.mode != RolloutMode.ASYNC:
        return
    check(r.max_staleness >= 0, "rollout.max_staleness", r.max_staleness, "must be >= 0 (steps)")
    check(r.threads >= 1, "rollout.threads", r.threads, "must be >= 1")
    check(r.timeout_s > 0, "rollout.timeout_s", r.timeout_s, "must be > 0 (seconds)")
    index = rollout_gpu_index(r.device)
    if index is not None:
        validate_rollout_gpu(index, r.device)


# rollout.device: where the generation worker runs.
ROLLOUT_DEVICE = re.compile(r"auto|cpu|cuda:(\d+)")


def rollout_gpu_index(value: str) -> int | None:
    """N of a `cuda:N` rollout.device; None for auto and cpu; a ConfigError for anything else."""
    match = ROLLOUT_DEVICE.fullmatch(value)
    if match is None:
        fail(
            "rollout.device",
            value,
            "must be auto, cpu or cuda:N (N: the GPU's index as torch numbers them in the trainer's process)",
        )
    return None if match.group(1) is None else int(match.group(1))


def validate_rollout_gpu(index: int, value: str) -> None:
    """rollout.device=cuda:N names a GPU torch sees here (the trainer's process numbers them the same)."""
    import torch  # only for this key: the rest of validation stays light

    count = torch.cuda.device_count()
    check(
        index < count,
        "rollout.device",
        value,
        f"torch sees {count} GPU(s) here (torch.cuda.device_count(), numbered from 0 after "
        "CUDA_VISIBLE_DEVICES); choose one of them, or rollout.device=cpu",
    )
