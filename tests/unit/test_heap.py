"""Releasing the heap's free pages gives fragmented memory back to the OS and touches no live tensor."""

import subprocess
import sys

import pytest
import torch

from grpo_run.heap import release_free_memory


def resident_mb() -> float:
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc and needs glibc's malloc_trim")
def test_freed_holes_between_live_tensors_leave_the_resident_set():
    keep, drop = [], []
    for i in range(4000):  # 64 KB each: below malloc's mmap threshold, so they share the heap
        (keep if i % 2 else drop).append(torch.full((16_000,), float(i)))
    drop.clear()  # 2000 x 64 KB = 125 MB of holes between live tensors: still resident
    before = resident_mb()
    assert release_free_memory()
    # 2000 holes of 62.5 pages each: at least 60 whole pages per hole go back, 117 MB in all.
    assert before - resident_mb() > 100
    assert all(bool((t == 2 * j + 1).all()) for j, t in enumerate(keep))  # live data untouched


# A subprocess per setting: the mmap threshold is the whole process's.
GROWING_TRANSIENTS = """
import subprocess
import sys
import torch
from grpo_run.heap import large_buffers_from_os
if sys.argv[1] == "on":
    assert large_buffers_from_os()
def resident_mb():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
warm = torch.ones(1 << 22)  # 16 MB mapped and unmapped: glibc's own threshold grows to it
del warm
base = resident_mb()
live = []
for i in range(40):
    transient = torch.ones((1 << 20) + i * 16_384)  # 4 MB and growing: no earlier hole fits it
    live.append(torch.ones(1000))  # a small long-lived tensor right after it
    del transient
print(resident_mb() - base)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc and needs glibc's mallopt")
def test_large_buffers_leave_the_resident_set_as_soon_as_they_are_freed():
    # 40 freed transients of 4-6.5 MB, each followed by a live 4 KB tensor: under glibc's grown
    # threshold (16 MB) they come from the heap and their holes stay resident (~200 MB); mapped from
    # the OS they are gone at once.
    def grown_mb(setting: str) -> float:
        out = subprocess.run(
            [sys.executable, "-c", GROWING_TRANSIENTS, setting], capture_output=True, text=True, check=True
        )
        return float(out.stdout.strip())

    assert grown_mb("off") > 100
    assert grown_mb("on") < 20


def thp_available() -> bool:
    try:
        return "[never]" not in open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return False


@pytest.mark.skipif(not thp_available(), reason="no transparent huge pages on this machine")
def test_large_buffers_come_in_huge_pages():
    # 64 MB written once: 16,384 faults of 4 KB pages, or 32 of 2 MB huge pages (a few hundred here
    # and there where the kernel falls back to small pages).
    code = (
        "import torch\nfrom grpo_run.heap import large_buffers_from_os\nlarge_buffers_from_os()\n"
        "def faults():\n    return int(open('/proc/self/stat').read().split()[9])\n"
        "f = faults()\ntorch.empty(16 << 20).fill_(1.0)\nprint(faults() - f)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert int(out.stdout.strip()) < 4096
