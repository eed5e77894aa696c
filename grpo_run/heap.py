"""Give the C heap's free pages back to the operating system between the phases of a step.

PyTorch's CPU tensors come from glibc malloc. Tensors below malloc's mmap threshold (which grows to
32 MB as large blocks are freed) live in heap arenas, and a step allocates thousands of them at sizes
that change with every batch's prompt and completion lengths. Freed blocks that no later request fits
stay resident, so a process's RSS creeps up over a run. `malloc_trim(0)` releases every free page of
every arena; it moves no live memory. Elsewhere than glibc it does nothing.

Released pages are not free to get back: the next phase that needs them faults each in again, which
costs ~1.7 µs a 4 KB page on the development VM (a fresh 16 MB buffer: 7 ms; refilling a resident one:
0.45 ms). A small model's heap holds a few MB free between phases, which come straight back: trimming
them made the tiny benchmark's step ~9% slower (README, Performance). So a trim needs `min_free` bytes
free in the arenas, as glibc's `mallinfo2` counts them.
"""

import ctypes
import ctypes.util
import os

# Below this much free heap a trim returns less than it costs to fault back in.
MIN_FREE_BYTES = 64 * 2**20

# oneDNN (torch's CPU kernels for bf16 matmuls) keeps every primitive it builds, one per input shape,
# in two LRU caches of 1,024 entries each: ideep's (LRU_CACHE_CAPACITY) and oneDNN's own
# (ONEDNN_PRIMITIVE_CACHE_CAPACITY). A generation makes a new shape at every decode step (the
# attention's key length grows, finished rows leave the batch), so both fill up, ~0.6 MB an entry here,
# and that memory stays in use through the update: 0.19 GB after generating 32 rows x 128 tokens on
# SmolLM2, whose update's own shapes fit in 64 entries with room to spare (README, Performance).
KERNEL_CACHE_ENTRIES = 64
KERNEL_CACHE_VARIABLES = ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY")


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _libc():
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return ctypes.CDLL(name)
    except OSError:
        return None


_LIBC = _libc()
_TRIM = getattr(_LIBC, "malloc_trim", None)
_INFO = getattr(_LIBC, "mallinfo2", None)  # glibc 2.33 and later
if _INFO is not None:
    _INFO.restype = _MallInfo2


def bound_kernel_caches(entries: int = KERNEL_CACHE_ENTRIES) -> dict[str, str]:
    """Cap oneDNN's primitive caches at `entries` each, unless the environment already sets them (a
    user's value wins). The libraries read these variables once, when they first build a primitive, so
    this runs before the first matmul of the process. Returns the values in force."""
    for name in KERNEL_CACHE_VARIABLES:
        os.environ.setdefault(name, str(entries))
    return {name: os.environ[name] for name in KERNEL_CACHE_VARIABLES}


def free_heap_bytes() -> int | None:
    """Bytes free inside malloc's arenas (resident or already given back), None where unknown."""
    return None if _INFO is None else int(_INFO().fordblks)


def release_free_memory(min_free: int = 0) -> bool:
    """Return the allocator's free pages to the OS when at least `min_free` bytes of the heap are free
    (where the C library cannot say, always); True when it trimmed."""
    if _TRIM is None:
        return False
    free = free_heap_bytes()
    if free is not None and free < min_free:
        return False
    _TRIM(0)
    return True
