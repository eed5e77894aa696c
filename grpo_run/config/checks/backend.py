"""backend: the fast path's chunk sizes and memory release."""

from grpo_run.config.checks.base import check
from grpo_run.config.schema import Config


def validate_backend(cfg: Config) -> None:
    b = cfg.backend
    check(b.logprob_chunk_size >= 1, "backend.logprob_chunk_size", b.logprob_chunk_size, "must be >= 1")
    check(
        b.release_free_memory_layers >= 0,
        "backend.release_free_memory_layers",
        b.release_free_memory_layers,
        "must be >= 0 (0: never between layers)",
    )
