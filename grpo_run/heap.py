"""Give the C heap's free pages back to the operating system between the phases of a step.

PyTorch's CPU tensors come from glibc malloc. Tensors below malloc's mmap threshold (which grows to
32 MB as large blocks are freed) live in heap arenas, and a step allocates thousands of them at sizes
that change with every batch's prompt and completion lengths. Freed blocks that no later request fits
stay resident, so a process's RSS creeps up over a run. `malloc_trim(0)` releases every free page of
every arena; it moves no live memory and costs milliseconds. Elsewhere than glibc it does nothing.
"""

import ctypes
import ctypes.util


def _malloc_trim():
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return getattr(ctypes.CDLL(name), "malloc_trim", None)
    except OSError:
        return None


_TRIM = _malloc_trim()


def release_free_memory() -> bool:
    """Return the allocator's free pages to the OS; True when the C library could do it."""
    if _TRIM is None:
        return False
    _TRIM(0)
    return True
