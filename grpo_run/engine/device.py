"""The process's device, seeds and peak memory."""

import random
import resource

import numpy as np
import torch

# The precision choice is made at the config's door (grpo_run/config/precision.py); re-exported here for
# the run's own warnings and the tests.
from grpo_run.config.precision import (  # noqa: F401
    BF16_FLAGS,
    cuda_computes_bf16,
    has_bf16_instructions,
    read_cpuinfo,
    resolve_autocast_bf16,
)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def peak_memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    # ru_maxrss is in KiB on Linux: the process's peak resident set.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def slow_bf16_warning(autocast_bf16: bool, device: torch.device) -> str | None:
    """One line for a CPU run that autocasts to bf16 on a CPU without bf16 instructions: there torch
    emulates bf16 matmuls, so float32 is far faster (docs/performance.md measures both)."""
    if not autocast_bf16 or device.type != "cpu":
        return None
    cpuinfo = read_cpuinfo()
    if cpuinfo is None or has_bf16_instructions(cpuinfo) is not False:
        return None
    return (
        "model.autocast_bf16=true on a CPU without bf16 instructions (no avx512_bf16 or amx_bf16 in "
        "/proc/cpuinfo): torch emulates bf16 matmuls here, far slower than float32; "
        "model.autocast_bf16=false trains in float32"
    )
