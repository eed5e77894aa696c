"""Give the C heap's free pages back to the operating system between the phases of a step.

PyTorch's CPU tensors come from glibc malloc. Tensors below malloc's mmap threshold (which grows to
32 MB as large blocks are freed) live in heap arenas, and a step allocates thousands of them at sizes
that change with every batch's prompt and completion lengths. Freed blocks that no later request fits
stay resident, so a process's RSS creeps up over a run. `malloc_trim(0)` releases every free page of
every arena; it moves no live memory. Elsewhere than glibc it does nothing.

Released pages are not free to get back: the next phase that needs them faults each in again, 4 KB
at a time, which costs far more than writing a page that is still resident. A small model's heap holds
a few MB free between phases, which come straight back, so trimming them only slows its step down.
Hence a trim needs `min_free` bytes free in the arenas, as glibc's `mallinfo2` counts them.
"""

import ctypes
import ctypes.util
import os

# Below this much free heap a trim returns less than it costs to fault back in.
MIN_FREE_BYTES = 64 * 2**20

# oneDNN (torch's CPU kernels for bf16 matmuls) keeps every primitive it builds, one per input shape,
# in two LRU caches of 1,024 entries each: ideep's (LRU_CACHE_CAPACITY) and oneDNN's own
# (ONEDNN_PRIMITIVE_CACHE_CAPACITY). A generation makes a new shape at every decode step (the
# attention's key length grows, finished rows leave the batch), so both fill up, and that memory stays
# in use through the update, whose own shapes fit in 64 entries with room to spare.
KERNEL_CACHE_ENTRIES = 64
KERNEL_CACHE_VARIABLES = ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY")

# Blocks of this size or more get a mapping of their own, unmapped when freed. glibc's threshold starts
# at 128 KB and follows the largest mapped block freed so far up to 32 MB, so after the first large free
# a layer's activations (megabytes each for a model of SmolLM2's size) come from the heap, between
# gradients that live until the optimizer step; their freed pages stay resident and add up, layer by
# layer of the backward between trims, at the update's peak. Blocks under 4 MB, which decode steps make
# by the thousand, stay on the heap, where reusing them costs no page faults.
MMAP_THRESHOLD_BYTES = 4 * 2**20
_M_MMAP_THRESHOLD = -3  # mallopt's parameter numbers in glibc's malloc.h
_M_TRIM_THRESHOLD = -1
# torch backs CPU allocations of 2 MB or more with transparent huge pages when this variable is 1: a
# mapped block then faults in 2 MB at a time rather than 4 KB, which is what makes the threshold above
# affordable (faulted in page by page, the mapped blocks would slow the update down several times more).
# torch reads it at its first CPU allocation, so it must be set before torch is imported.
HUGE_PAGES_VARIABLE = "THP_MEM_ALLOC_ENABLE"


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
_MALLOPT = getattr(_LIBC, "mallopt", None) if _INFO is not None else None  # glibc's mallopt only
if _INFO is not None:
    _INFO.restype = _MallInfo2


def bound_kernel_caches(entries: int = KERNEL_CACHE_ENTRIES) -> dict[str, str]:
    """Cap oneDNN's primitive caches at `entries` each, unless the environment already sets them (a
    user's value wins). The libraries read these variables once, when they first build a primitive, so
    this runs before the first matmul of the process. Returns the values in force."""
    for name in KERNEL_CACHE_VARIABLES:
        os.environ.setdefault(name, str(entries))
    return {name: os.environ[name] for name in KERNEL_CACHE_VARIABLES}


def prepare_process() -> None:
    """The allocator settings of a grpo-run process, made before torch is imported (`grpo_run.cli`):
    oneDNN's caches bounded, large CPU tensors on huge pages and in mappings of their own. Each one
    yields to a value the user set in the environment."""
    bound_kernel_caches()
    os.environ.setdefault(HUGE_PAGES_VARIABLE, "1")
    map_large_blocks()


def map_large_blocks(threshold: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Have malloc map blocks of `threshold` bytes or more on their own (glibc's `M_MMAP_THRESHOLD`,
    which also stops the threshold from rising), and keep up to twice that free at the heap's top, the
    relation glibc's moving threshold keeps: a fixed threshold also freezes the top's trim threshold at
    128 KB, and then the heap shrinks and grows again (page faults and all) around every transient
    block at its top, which slows a small model's update down. False where the C
    library is not glibc or the user set a threshold (`MALLOC_MMAP_THRESHOLD_`, `GLIBC_TUNABLES`)."""
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    if _MALLOPT is None or "MALLOC_MMAP_THRESHOLD_" in os.environ or "mmap_threshold" in tunables:
        return False
    return bool(_MALLOPT(_M_MMAP_THRESHOLD, threshold)) and bool(_MALLOPT(_M_TRIM_THRESHOLD, 2 * threshold))


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
