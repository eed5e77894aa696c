"""The reward levels a cost per tool call is checked against (`env.reward_levels` null): derived from the
run's reward functions and their registry ranges, when the run is built, before any model loads."""

from grpo_run.config.checks.env import check_call_cost_margin
from grpo_run.config.schema import Config
from grpo_run.config.validation import ConfigError
from grpo_run.rewards.call_cost import derived_levels
from grpo_run.rewards.names import RewardName
from grpo_run.scoring.run_scorer import reward_specs

# The gold checks: 1 correct, 0 wrong (code_exec with fraction: a share of asserts, partial credit).
GOLD_CHECKS = {RewardName.MATH_VERIFIER.value, RewardName.CODE_EXEC.value, RewardName.REASONING_GYM.value}


def reward_levels(cfg: Config) -> tuple[float, float] | None:
    """(wrong_max, correct_min) of reward.functions' weighted total; None when they cannot be derived (no
    gold check, or an entry whose range is unknown)."""
    terms = []
    for fn, spec in zip(cfg.reward.functions, reward_specs(cfg.reward), strict=True):
        entry = spec.entry
        builtin = fn._target_ is None and fn.model is None
        gold = (
            builtin
            and fn.name in GOLD_CHECKS
            and not (fn.name == RewardName.CODE_EXEC and fn.kwargs.get("fraction"))
        )
        bounds = None if entry is None or entry.range is None else entry.range(spec.kwargs)
        terms.append((spec.weight, gold, bounds))
    return derived_levels(terms)


def check_call_cost_levels(cfg: Config) -> None:
    """env.call_cost > 0 with env.reward_levels null: the levels derived here, the margin checked; a
    ConfigError naming env.reward_levels when they cannot be derived."""
    e = cfg.env
    if e.call_cost == 0 or e.reward_levels is not None:  # explicit levels: checked with the config
        return
    levels = reward_levels(cfg)
    if levels is None:
        raise ConfigError(
            f"env.reward_levels=None: env.call_cost={e.call_cost!r} needs the reward's levels and "
            "reward.functions gives none to derive them from (no gold check: math_verifier, code_exec, "
            "reasoning_gym; or an entry without a known range); "
            "set env.reward_levels=[wrong_max, correct_min]"
        )
    check_call_cost_margin(cfg, levels, "reward.functions")
