"""Releasing the heap's free pages gives fragmented memory back to the OS and touches no live tensor."""

import sys

import pytest
import torch

from grpo_run.heap import free_heap_bytes, release_free_memory


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
