"""grpo and kl_control: the group, the clip, the algorithm variants (docs/algorithm.md).

The policy loss's own knobs are checked by its entry in `grpo_run.algo.losses.POLICY_LOSSES`; here
those problems become errors naming the grpo keys.
"""

from grpo_run.algo.enums import AdvantageMode, EntropyControl, RewardAggregation, RolloutCorrection
from grpo_run.algo.losses import knob_problems
from grpo_run.config.checks.base import check, fail, refuse
from grpo_run.config.schema import Config, KLControlKind


def validate_grpo(cfg: Config) -> None:
    g = cfg.grpo
    check(g.group_size >= 2, "grpo.group_size", g.group_size, "must be >= 2 (a group compares completions)")
    check(g.beta >= 0, "grpo.beta", g.beta, "must be >= 0")
    check(0 < g.epsilon < 1, "grpo.epsilon", g.epsilon, "must lie in (0, 1)")
    if g.epsilon_high is not None:
        check(g.epsilon_high > 0, "grpo.epsilon_high", g.epsilon_high, "must be > 0 (or null for epsilon)")
    check(g.num_iterations >= 1, "grpo.num_iterations", g.num_iterations, "must be >= 1")
    check(g.advantage_eps >= 0, "grpo.advantage_eps", g.advantage_eps, "must be >= 0")


def validate_variants(cfg: Config) -> None:
    """The algorithm variants (docs/algorithm.md): each knob's range, what needs one process."""
    g = cfg.grpo
    if g.clip_ratio_c is not None:
        check(g.clip_ratio_c > 1, "grpo.clip_ratio_c", g.clip_ratio_c, "must be > 1 (dual clip), or null")
    check(g.constant_length >= 1, "grpo.constant_length", g.constant_length, "must be >= 1 (tokens)")
    check(g.entropy_coef >= 0, "grpo.entropy_coef", g.entropy_coef, "must be >= 0 (a bonus for entropy)")
    check(g.max_resample_rounds >= 1, "grpo.max_resample_rounds", g.max_resample_rounds, "must be >= 1")
    validate_kl_control(cfg)
    world = cfg.distributed.nproc_per_node * cfg.distributed.nnodes
    # A batch-level std needs the whole step's groups in one place: it would be each rank's own.
    # (Dynamic sampling agrees across ranks: `rollout.groups.sample_groups`.)
    if world > 1:
        check(
            g.advantage_mode != AdvantageMode.NORMALIZED_BATCH,
            "grpo.advantage_mode",
            g.advantage_mode.value,
            "normalized_batch needs one process for now (its std would be each rank's own)",
        )
    validate_policy_loss(cfg)
    validate_loss_knobs(cfg)


def validate_kl_control(cfg: Config) -> None:
    kc = cfg.kl_control
    check(kc.target > 0, "kl_control.target", kc.target, "must be > 0 (the KL per token beta steers to)")
    check(kc.horizon >= 1, "kl_control.horizon", kc.horizon, "must be >= 1 (completions)")
    if kc.kind == KLControlKind.ADAPTIVE:
        check(
            cfg.grpo.beta > 0,
            "grpo.beta",
            cfg.grpo.beta,
            "kl_control=adaptive scales beta, so it must start > 0",
        )


def validate_policy_loss(cfg: Config) -> None:
    """grpo.policy_loss and the keys that belong to one surrogate only: the first problem its entry in
    POLICY_LOSSES finds, named by its grpo keys."""
    problem = next(knob_problems(vars(cfg.grpo)), None)
    if problem is None:
        return
    key = f"grpo.{problem.key}"
    if problem.other is None:
        fail(key, problem.value, problem.why)
    refuse(True, key, problem.value, f"grpo.{problem.other}", problem.other_value, problem.why)


def validate_loss_knobs(cfg: Config) -> None:
    """The knobs that compose with every surrogate: entropy quantile, off-policy mask, KL correction,
    adaptive entropy, GDPO and the sampler correction's lower bound."""
    g = cfg.grpo
    q = g.top_entropy_quantile
    check(0 < q <= 1, "grpo.top_entropy_quantile", q, "must lie in (0, 1] (1 keeps every token)")
    if g.off_policy_mask_threshold is not None:
        t = g.off_policy_mask_threshold
        check(t >= 0, "grpo.off_policy_mask_threshold", t, "must be >= 0 (a KL), or null")
    if g.kl_bias_correction:
        refuse(
            g.beta == 0,
            "grpo.kl_bias_correction",
            True,
            "grpo.beta",
            g.beta,
            "there is no KL term to correct",
        )
    if g.entropy_control == EntropyControl.ADAPTIVE:
        validate_adaptive_entropy(cfg)
    if cfg.reward.aggregation == RewardAggregation.NORMALIZE_THEN_SUM:
        validate_gdpo(cfg)
    if g.rollout_correction_min is not None:
        lo = g.rollout_correction_min
        refuse(
            g.rollout_correction == RolloutCorrection.NONE,
            "grpo.rollout_correction_min",
            lo,
            "grpo.rollout_correction",
            g.rollout_correction.value,
            "there is no weight to bound",
        )
        check(
            0 <= lo < g.rollout_correction_cap,
            "grpo.rollout_correction_min",
            lo,
            f"must lie in [0, grpo.rollout_correction_cap={g.rollout_correction_cap})",
        )


def validate_adaptive_entropy(cfg: Config) -> None:
    """grpo.entropy_control=adaptive: the target, the step and the coefficient's band."""
    g = cfg.grpo
    check(g.entropy_target > 0, "grpo.entropy_target", g.entropy_target, "must be > 0 (nats)")
    check(g.entropy_coef_delta > 0, "grpo.entropy_coef_delta", g.entropy_coef_delta, "must be > 0")
    check(g.entropy_coef_min >= 0, "grpo.entropy_coef_min", g.entropy_coef_min, "must be >= 0")
    check(
        g.entropy_coef_min <= g.entropy_coef <= g.entropy_coef_max,
        "grpo.entropy_coef",
        g.entropy_coef,
        f"must lie in [grpo.entropy_coef_min, grpo.entropy_coef_max] = [{g.entropy_coef_min}, "
        f"{g.entropy_coef_max}] (the adaptive coefficient starts there)",
    )


def validate_gdpo(cfg: Config) -> None:
    """reward.aggregation=normalize_then_sum (GDPO): normalized advantages, distinct names, one process."""
    g = cfg.grpo
    agg = cfg.reward.aggregation.value
    refuse(
        g.advantage_mode != AdvantageMode.NORMALIZED,
        "grpo.advantage_mode",
        g.advantage_mode.value,
        "reward.aggregation",
        agg,
        "GDPO normalises each function in its group and the sum over the step; keep advantage_mode=normalized",
    )
    names = [fn.name for fn in cfg.reward.functions]
    refuse(
        len(set(names)) < len(names),
        "reward.aggregation",
        agg,
        "reward.functions",
        names,
        "each function is normalised by its name, so the names must differ",
    )
    world = cfg.distributed.nproc_per_node * cfg.distributed.nnodes
    refuse(
        world > 1,
        "reward.aggregation",
        agg,
        "distributed.nproc_per_node",
        cfg.distributed.nproc_per_node,
        "its step-level std would be each rank's own; one process for now",
    )


def validate_sampler_correction(cfg: Config) -> None:
    g = cfg.grpo
    check(
        g.rollout_correction_cap > 0,
        "grpo.rollout_correction_cap",
        g.rollout_correction_cap,
        "must be > 0 (the bound on pi_old / pi_sampler)",
    )
