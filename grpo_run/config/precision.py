"""Precision by hardware: `model.autocast_bf16=auto` resolved to a plain bool at the config's door.

Pure but for reading /proc/cpuinfo and asking torch about CUDA, so the config layer can decide before any
model loads (and without importing the engines above it).
"""

from grpo_run.config.schema import Config, Mode

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
    import torch  # only when a config asks for auto

    return torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False)


def compute_device(config: Config) -> tuple[str, bool]:
    """(device type, whether it computes bf16) of trainer.device, or under mode=plan of the device the plan
    is for (plan.gpu / plan.device_memory_gb name a GPU; plan.gpu's presets all compute bf16)."""
    import torch

    wanted = config.trainer.device
    if wanted == "cpu":
        return "cpu", False
    if config.mode == Mode.PLAN and (config.plan.gpu is not None or config.plan.device_memory_gb is not None):
        return "cuda", config.plan.gpu is not None or cuda_computes_bf16()
    if torch.cuda.is_available():  # trainer.device=cuda without a GPU failed validation
        return "cuda", cuda_computes_bf16()
    return "cpu", False


def resolve_config_autocast(config: Config, setting: bool | str) -> tuple[bool, str]:
    """The door's choice for `setting` (True, False or "auto") on the device this config runs on."""
    if setting != "auto":
        return resolve_autocast_bf16(setting, "cpu", cpuinfo=None, cuda_bf16=False)
    device_type, cuda_bf16 = compute_device(config)
    cpuinfo = read_cpuinfo() if device_type == "cpu" else None
    return resolve_autocast_bf16(setting, device_type, cpuinfo=cpuinfo, cuda_bf16=cuda_bf16)
