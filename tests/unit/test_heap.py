"""Releasing the heap's free pages gives fragmented memory back to the OS and touches no live tensor;
oneDNN's primitive caches are bounded unless the user sized them."""

import os
import subprocess
import sys

import pytest
import torch

from grpo_run.heap import KERNEL_CACHE_VARIABLES, bound_kernel_caches, free_heap_bytes, release_free_memory


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


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc and needs glibc's malloc_trim")
def test_a_heap_with_less_free_than_asked_is_left_as_it_is():
    keep, drop = [], []
    for i in range(400):  # 64 KB each, every other one freed: 12.5 MB of holes
        (keep if i % 2 else drop).append(torch.full((16_000,), float(i)))
    drop.clear()
    free = free_heap_bytes()
    if free is None:
        pytest.skip("this C library has no mallinfo2")
    assert free >= 12 * 2**20  # the holes, at least
    before = resident_mb()
    assert not release_free_memory(min_free=free + 2**30)  # asks for a GB more than there is
    assert resident_mb() >= before - 1  # nothing went back
    assert release_free_memory(min_free=free // 2)
    assert before - resident_mb() > 10  # now the holes' pages did


def test_the_kernel_caches_are_bounded_unless_the_user_set_them(monkeypatch):
    monkeypatch.delenv("LRU_CACHE_CAPACITY", raising=False)
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "1000")  # the user's
    assert bound_kernel_caches() == {"LRU_CACHE_CAPACITY": "64", "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "1000"}


# Many bf16 matmul shapes (a decode loop's growing attention keys) in a fresh process: in-use heap growth.
_SHAPES = """
import sys, torch
from grpo_run.heap import bound_kernel_caches, _INFO
if sys.argv[1] == "bounded":
    bound_kernel_caches()
torch.set_num_threads(1)
q = torch.randn(8, 3, 1, 64).bfloat16()
before = _INFO().uordblks
for t in range(1, 300):
    q @ torch.randn(8, 3, 64, 20 + t).bfloat16()
print((_INFO().uordblks - before) / 2**20)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads glibc's mallinfo2")
def test_bounded_kernel_caches_keep_less_memory_after_many_shapes():
    env = {k: v for k, v in os.environ.items() if k not in KERNEL_CACHE_VARIABLES}
    env["OMP_NUM_THREADS"] = "1"

    def growth_mb(mode: str) -> float:
        out = subprocess.run([sys.executable, "-c", _SHAPES, mode], env=env, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        return float(out.stdout.split()[-1])

    unbounded = growth_mb("default")
    if unbounded < 50:  # this CPU's bf16 matmuls build no cached primitives (no oneDNN bf16 path)
        pytest.skip(f"bf16 matmuls kept {unbounded:.0f} MB over 299 shapes: nothing to bound here")
    bounded = growth_mb("bounded")
    # 299 shapes: ~0.6 MB an entry kept up to 1,024 entries by default, up to 64 when bounded.
    assert bounded < unbounded / 2, (bounded, unbounded)
