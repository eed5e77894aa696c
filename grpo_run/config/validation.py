"""Checks on values that types alone cannot express. Every error names the full key and the value."""

import math

from grpo_run.config.schema import Config, ModelKind
from grpo_run.data.sources import DataSource


class ConfigError(ValueError):
    """An invalid configuration value; the message names the key and the value it got."""


def _fail(key: str, value: object, why: str) -> None:
    raise ConfigError(f"{key}={value!r}: {why}")


def _check(ok: bool, key: str, value: object, why: str) -> None:
    if not ok:
        _fail(key, value, why)


def validate(cfg: Config) -> None:
    g, t, gen = cfg.grpo, cfg.trainer, cfg.generation
    _check(g.group_size >= 2, "grpo.group_size", g.group_size, "must be >= 2 (a group compares completions)")
    _check(g.beta >= 0, "grpo.beta", g.beta, "must be >= 0")
    _check(0 < g.epsilon < 1, "grpo.epsilon", g.epsilon, "must lie in (0, 1)")
    if g.epsilon_high is not None:
        _check(g.epsilon_high > 0, "grpo.epsilon_high", g.epsilon_high, "must be > 0 (or null for epsilon)")
    _check(g.num_iterations >= 1, "grpo.num_iterations", g.num_iterations, "must be >= 1")
    _check(g.advantage_eps >= 0, "grpo.advantage_eps", g.advantage_eps, "must be >= 0")

    _check(t.max_steps >= 1, "trainer.max_steps", t.max_steps, "must be >= 1")
    _check(t.prompts_per_step >= 1, "trainer.prompts_per_step", t.prompts_per_step, "must be >= 1")
    _check(t.micro_batch_size >= 1, "trainer.micro_batch_size", t.micro_batch_size, "must be >= 1")
    completions = t.prompts_per_step * g.group_size
    if completions % t.micro_batch_size:
        _fail(
            "trainer.micro_batch_size",
            t.micro_batch_size,
            f"must divide trainer.prompts_per_step * grpo.group_size = "
            f"{t.prompts_per_step} * {g.group_size} = {completions} completions per step",
        )
    _check(t.lr > 0 and math.isfinite(t.lr), "trainer.lr", t.lr, "must be a finite number > 0")
    _check(t.warmup_steps >= 0, "trainer.warmup_steps", t.warmup_steps, "must be >= 0")
    _check(t.max_grad_norm > 0, "trainer.max_grad_norm", t.max_grad_norm, "must be > 0")
    _check(t.logprob_chunk_size >= 1, "trainer.logprob_chunk_size", t.logprob_chunk_size, "must be >= 1")
    _check(t.device in ("auto", "cpu", "cuda"), "trainer.device", t.device, "must be auto, cpu or cuda")

    _check(gen.max_new_tokens >= 1, "generation.max_new_tokens", gen.max_new_tokens, "must be >= 1")
    _check(gen.temperature > 0, "generation.temperature", gen.temperature, "must be > 0")
    _check(0 < gen.top_p <= 1, "generation.top_p", gen.top_p, "must lie in (0, 1]")
    _check(gen.top_k >= 0, "generation.top_k", gen.top_k, "must be >= 0 (0 disables it)")
    _check(gen.backend == "hf", "generation.backend", gen.backend, "only 'hf' is available")

    _check(len(cfg.reward.functions) > 0, "reward.functions", [], "needs at least one reward function")
    from grpo_run.rewards.registry import RewardName  # light module: names only

    known = [n.value for n in RewardName]
    for i, fn in enumerate(cfg.reward.functions):
        _check(fn.name in known, f"reward.functions[{i}].name", fn.name, f"unknown reward; known: {known}")
        _check(math.isfinite(fn.weight), f"reward.functions[{i}].weight", fn.weight, "must be finite")
    _check(cfg.reward.timeout_s > 0, "reward.timeout_s", cfg.reward.timeout_s, "must be > 0")

    if cfg.model.kind == ModelKind.PRETRAINED:
        _check(
            bool(cfg.model.path),
            "model.path",
            cfg.model.path,
            "model.kind=pretrained needs a hub id or folder",
        )
    d = cfg.data
    if d.source == DataSource.JSONL:
        _check(bool(d.train_path), "data.train_path", d.train_path, "data.source=jsonl needs a file path")
    if d.source == DataSource.ARITHMETIC:
        _check(
            d.train_size is not None, "data.train_size", d.train_size, "data.source=arithmetic needs a size"
        )
        _check(d.eval_size is not None, "data.eval_size", d.eval_size, "data.source=arithmetic needs a size")
    if d.train_size is not None:
        _check(d.train_size >= 1, "data.train_size", d.train_size, "must be >= 1")
    if d.eval_size is not None:
        _check(d.eval_size >= 1, "data.eval_size", d.eval_size, "must be >= 1 (or null)")
    _check(
        "{question}" in d.prompt_template,
        "data.prompt_template",
        d.prompt_template,
        "must contain {question}",
    )
