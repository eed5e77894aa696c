"""Give the C heap's free pages back to the operating system between the phases of a step.

PyTorch's CPU tensors come from glibc malloc. Tensors below malloc's mmap threshold (which grows to
32 MB as large blocks are freed) live in heap arenas, and a step allocates thousands of them at sizes
that change with every batch's prompt and completion lengths. Freed blocks that no later request fits
stay resident, so a process's RSS creeps up over a run. `malloc_trim(0)` releases every free page of
every arena; it moves no live memory and costs milliseconds. Elsewhere than glibc it does nothing.

Within a phase trimming is too late: the update's large transients (a layer's activations, a chunk of
logits) land in the arenas between long-lived tensors (the checkpointed layer inputs), and the peak
counts every freed block still resident. `large_buffers_from_os` fixes malloc's mmap threshold at
`LARGE_BUFFER` (no more growth to 32 MB): larger blocks are mapped on allocation and unmapped on free,
and torch backs them with transparent huge pages (`THP_MEM_ALLOC_ENABLE`), one page fault per 2 MB
instead of 512 for the fresh pages each mapping needs.
"""

import ctypes
import ctypes.util
import os

LARGE_BUFFER = 2 << 20  # bytes: torch's own threshold for transparent huge pages
_M_MMAP_THRESHOLD = -3  # mallopt's parameter number in glibc's malloc.h


def _libc_function(name: str):
    lib = ctypes.util.find_library("c")
    if lib is None:
        return None
    try:
        return getattr(ctypes.CDLL(lib), name, None)
    except OSError:
        return None


_TRIM = _libc_function("malloc_trim")
_MALLOPT = _libc_function("mallopt")


def release_free_memory() -> bool:
    """Return the allocator's free pages to the OS; True when the C library could do it."""
    if _TRIM is None:
        return False
    _TRIM(0)
    return True


def large_buffers_from_os() -> bool:
    """Map blocks of LARGE_BUFFER bytes and more straight from the OS and return them on free, in huge
    pages (module docstring); True when the C library took the setting. Call it before the run's first
    large tensor; a THP_MEM_ALLOC_ENABLE set by the user wins."""
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    if _MALLOPT is None:
        return False
    return bool(_MALLOPT(_M_MMAP_THRESHOLD, LARGE_BUFFER))
