"""The sandbox's knobs: which isolation to ask for, and the limits of one program (reward kwargs)."""

from dataclasses import dataclass
from enum import StrEnum


class Isolation(StrEnum):
    AUTO = "auto"  # namespaces when the kernel allows them, else the audit-hook fallback (logged)
    NAMESPACES = "namespaces"  # namespaces or a sandbox failure (every completion unscorable)
    AUDIT = "audit"  # the weak fallback only (tests; kernels without user namespaces)


@dataclass(frozen=True)
class Limits:
    wall_s: float = 5.0  # wall clock, from start to the kill of the whole sandbox
    cpu_s: int = 5  # RLIMIT_CPU of the program's process (SIGKILL one second later)
    memory_mb: int = 1024  # RLIMIT_AS per process
    file_mb: int = 16  # RLIMIT_FSIZE: largest file the program may write
    processes: int = 16  # RLIMIT_NPROC: processes of the program's uid (in its user namespace)
    open_files: int = 64  # RLIMIT_NOFILE
