"""env= (docs/environments.md): its limits. The environment's name and `_target_` are resolved by
`grpo_run.envs.registry.check_environment` when the run is built, before the model loads."""

import math

from grpo_run.config.checks.base import check
from grpo_run.config.schema import Config


def validate_env(cfg: Config) -> None:
    e = cfg.env
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
