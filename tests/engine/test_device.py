"""Which CPUs get the slow-bf16 line: read from /proc/cpuinfo's flags (grpo_run/engine/device.py)."""

import torch

from grpo_run.engine import device

# Trimmed /proc/cpuinfo texts of the machine kinds this project runs on.
AMD_AVX2 = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse sse2 avx avx2 fma\n"
AMD_ZEN4 = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16 fma\n"
XEON_AMX = "processor\t: 0\nflags\t\t: fpu avx2 avx512f amx_bf16 amx_tile\n"
ARM = "processor\t: 0\nFeatures\t: fp asimd bf16\n"


def test_bf16_instructions_are_read_from_the_flags_line():
    assert device.has_bf16_instructions(AMD_AVX2) is False
    assert device.has_bf16_instructions(AMD_ZEN4) is True
    assert device.has_bf16_instructions(XEON_AMX) is True
    assert device.has_bf16_instructions(ARM) is None  # no x86 flags line: unknown, so no warning
    assert device.has_bf16_instructions("") is None


def test_the_warning_names_the_key_only_for_bf16_autocast_on_such_a_cpu(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    real = device.has_bf16_instructions
    monkeypatch.setattr(device, "has_bf16_instructions", lambda _: real(AMD_AVX2))
    line = device.slow_bf16_warning(True, cpu)
    assert line is not None and "model.autocast_bf16=false" in line
    assert device.slow_bf16_warning(False, cpu) is None
    assert device.slow_bf16_warning(True, cuda) is None
    monkeypatch.setattr(device, "has_bf16_instructions", lambda _: real(XEON_AMX))
    assert device.slow_bf16_warning(True, cpu) is None
