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


def read_cpuinfo() -> str | None:
    """/proc/cpuinfo's text; None where there is no such file (not Linux)."""
    try:
        with open("/proc/cpuinfo") as f:
            return f.read()
    except OSError:
        return None


def resolve_autocast_bf16(
    setting: bool | str, device_type: str, *, cpuinfo: str | None, cuda_bf16: bool
) -> tuple[bool, str]:
    """`model.autocast_bf16` (True, False or "auto") on a `device_type` ("cpu" | "cuda") as a plain bool,
    and one line saying why. auto: bf16 where the hardware computes it (a CUDA device with bf16, a CPU
    whose flags name avx512_bf16 or amx_bf16), float32 elsewhere: emulated bf16 is far slower than float32."""
    if setting != "auto":
        on = bool(setting)
        return on, f"precision: {_precision(on)} (model.autocast_bf16={str(on).lower()})"
    if device_type == "cuda":
        why = "CUDA device with bf16" if cuda_bf16 else "this CUDA device has no bf16, torch would emulate it"
        return cuda_bf16, f"precision: {_precision(cuda_bf16)} (auto: {why})"
    text = cpuinfo or ""
    known = has_bf16_instructions(text)
    if known is None:
        why = "/proc/cpuinfo lists no x86 flags (not an x86 CPU?), so bf16 support is unknown"
    elif known:
        why = "this CPU has " + "/".join(f for f in BF16_FLAGS if f in text.split())
    else:
        why = "this CPU has no " + "/".join(BF16_FLAGS) + ", torch would emulate bf16"
    return bool(known), f"precision: {_precision(bool(known))} (auto: {why})"


def _precision(bf16: bool) -> str:
    return "bf16 autocast" if bf16 else "float32"


def cuda_computes_bf16() -> bool:
    """Whether the first CUDA device computes bf16 in hardware (Ampere and later), emulation not counted."""
    return torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False)


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
