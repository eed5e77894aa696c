"""The process's device, seeds and peak memory."""

import random
import resource

import numpy as np
import torch


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


# x86 flags whose presence means bf16 matmuls run in hardware (oneDNN's AVX512-BF16 and AMX kernels).
BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def has_bf16_instructions(cpuinfo: str) -> bool | None:
    """Whether /proc/cpuinfo's text names a bf16 matmul instruction set; None when it lists no x86 flags
    (another architecture, or no such file): then nothing is known."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return any(flag in value.split() for flag in BF16_FLAGS)
    return None


def slow_bf16_warning(autocast_bf16: bool, device: torch.device) -> str | None:
    """One line for a CPU run that autocasts to bf16 on a CPU without bf16 instructions: there torch
    emulates bf16 matmuls, so float32 is far faster (docs/performance.md measures both)."""
    if not autocast_bf16 or device.type != "cpu":
        return None
    try:
        with open("/proc/cpuinfo") as f:
            known = has_bf16_instructions(f.read())
    except OSError:
        return None
    if known is not False:
        return None
    return (
        "model.autocast_bf16=true on a CPU without bf16 instructions (no avx512_bf16 or amx_bf16 in "
        "/proc/cpuinfo): torch emulates bf16 matmuls here, far slower than float32; "
        "model.autocast_bf16=false trains in float32"
    )
