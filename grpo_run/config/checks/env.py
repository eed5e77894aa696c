"""env= (docs/environments.md): its limits, the cost per tool call and the tool-free share. The
environment's name and `_target_` are resolved by `grpo_run.envs.registry.check_environment` when the run
is built, before the model loads; so are reward levels derived from reward.functions
(`grpo_run.scoring.levels`)."""

import math

from grpo_run.algo.enums import RewardAggregation
from grpo_run.config.checks.base import check, fail, refuse
from grpo_run.config.schema import Config
from grpo_run.rewards.call_cost import CostForm, margin_problem


def validate_env(cfg: Config) -> None:
    e = cfg.env
    validate_call_cost(cfg)
    validate_tool_free_share(cfg)
    if e._target_ is None and e.name == "single_turn":
        return
    check(e.max_turns >= 1, "env.max_turns", e.max_turns, "must be >= 1 (model turns per episode)")
    check(
        e.max_total_tokens >= 1,
        "env.max_total_tokens",
        e.max_total_tokens,
        "must be >= 1 (model and observation tokens after the prompt)",
    )
    ok = e.tool_timeout_s > 0 and math.isfinite(e.tool_timeout_s)
    check(ok, "env.tool_timeout_s", e.tool_timeout_s, "must be a finite number of seconds > 0")
    check(e.max_observation_chars >= 1, "env.max_observation_chars", e.max_observation_chars, "must be >= 1")
    if e.reward_levels is not None:
        check_call_cost_margin(
            cfg, (float(e.reward_levels[0]), float(e.reward_levels[1])), "env.reward_levels"
        )


def tool_free_count(share: float, group_size: int) -> int:
    """k: the tool-free episodes of each group under env.tool_free_share, share x G rounded to the nearest
    whole number, halves up (the rollout reads this too, so the check and the run agree)."""
    return math.floor(share * group_size + 0.5)


def validate_tool_free_share(cfg: Config) -> None:
    e, share = cfg.env, cfg.env.tool_free_share
    check(math.isfinite(share) and 0 <= share < 1, "env.tool_free_share", share, "must be in [0, 1) (0: off)")
    if share == 0:
        return
    if e._target_ is None and e.name == "single_turn":
        fail("env.tool_free_share", share, "needs a tool: env=single_turn has none (env=calculator, ...)")
    g = cfg.grpo.group_size
    k = tool_free_count(share, g)
    refuse(
        not 0 < k < g,
        "env.tool_free_share",
        share,
        "grpo.group_size",
        g,
        f"round({share:g} x {g}) = {k} tool-free episodes per group; it must be between 1 and {g - 1}",
    )


def validate_call_cost(cfg: Config) -> None:
    e = cfg.env
    c = e.call_cost
    check(math.isfinite(c) and c >= 0, "env.call_cost", c, "must be a finite number >= 0 (0: no cost)")
    if e.cost_form == CostForm.MULTIPLICATIVE:
        check(c < 1, "env.call_cost", c, "must be < 1 with env.cost_form=multiplicative (r * (1 - c)**k)")
    if c > 0 and e._target_ is None and e.name == "single_turn":
        fail("env.call_cost", c, "needs a tool: env=single_turn has none (env=calculator, env=python_tool)")
    gdpo = cfg.reward.aggregation == RewardAggregation.NORMALIZE_THEN_SUM
    refuse(
        c > 0 and gdpo,
        "env.call_cost",
        c,
        "reward.aggregation",
        cfg.reward.aggregation.value,
        "GDPO normalises each function's own values, so a cost on the episode's total would not reach them",
    )
    levels = e.reward_levels
    if levels is not None:
        ok = len(levels) == 2 and all(math.isfinite(x) for x in levels) and levels[0] < levels[1]
        check(
            ok,
            "env.reward_levels",
            list(levels),
            "must be [wrong_max, correct_min], finite, wrong_max < correct_min",
        )


def check_call_cost_margin(cfg: Config, levels: tuple[float, float], source: str) -> None:
    """A ConfigError naming env.call_cost when the cost could rank a wrong episode at or above a correct
    one under `levels` (wrong_max, correct_min), K = env.max_turns calls at most; `source` says where the
    levels came from."""
    e = cfg.env
    if e.call_cost == 0:
        return
    why = margin_problem(levels, e.call_cost, e.cost_form, e.max_turns)
    if why is not None:
        fail(
            "env.call_cost",
            e.call_cost,
            f"{why} (reward levels [wrong_max, correct_min] = {list(levels)} from {source}; "
            f"env.max_turns={e.max_turns} bounds the calls per episode)",
        )
