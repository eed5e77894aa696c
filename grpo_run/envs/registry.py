"""Environments by name, and the one place `env=` becomes an `Environment` (or None: single_turn)."""

from collections.abc import Callable

from grpo_run.config.schema import EnvConfig
from grpo_run.envs.base import DetectsCalls, Environment

SINGLE_TURN = "single_turn"

# name -> factory(env config) for the shipped environments and those a user registers.
ENVIRONMENTS: dict[str, Callable[[EnvConfig], Environment]] = {}


def register_environment(name: str, factory: Callable[[EnvConfig], Environment]) -> None:
    """Make `env.name=<name>` build `factory(env_config)`."""
    if name == SINGLE_TURN:
        raise ValueError(f"{SINGLE_TURN!r} is the run without an environment")
    ENVIRONMENTS[name] = factory


def _calculator(cfg: EnvConfig) -> Environment:
    from grpo_run.envs.calculator import Calculator

    return Calculator(**cfg.kwargs)


def _python_tool(cfg: EnvConfig) -> Environment:
    from grpo_run.envs.python_tool import PythonTool

    return PythonTool(timeout_s=cfg.tool_timeout_s, **cfg.kwargs)


register_environment("calculator", _calculator)
register_environment("python_tool", _python_tool)


def is_multi_turn(cfg: EnvConfig) -> bool:
    return cfg._target_ is not None or cfg.name != SINGLE_TURN


def check_environment(cfg: EnvConfig) -> None:
    """env.name is known, or env._target_ names something callable; a ConfigError naming the key if not."""
    from grpo_run.config.validation import ConfigError

    if not is_multi_turn(cfg):
        return
    if cfg._target_ is not None:
        from hydra.utils import get_object

        try:
            target = get_object(cfg._target_)
        except Exception as err:  # an import error, a missing attribute: the user's path is wrong
            raise ConfigError(f"env._target_={cfg._target_!r}: cannot be imported ({err})") from None
        if not callable(target):
            raise ConfigError(f"env._target_={cfg._target_!r}: is not a class or a function")
        return
    if cfg.name not in ENVIRONMENTS:
        known = ", ".join([SINGLE_TURN, *sorted(ENVIRONMENTS)])
        raise ConfigError(
            f"env.name={cfg.name!r}: unknown environment (known: {known}; or set env._target_ to your own)"
        )


def build_environment(cfg: EnvConfig) -> Environment | None:
    """The run's environment: None for single_turn (today's path); `env._target_` called with
    `env.kwargs`; else the registered factory of `env.name`. With env.tool_free_share > 0 it must tell a
    call without running it (`DetectsCalls`); a ConfigError naming the key and the environment if not."""
    if not is_multi_turn(cfg):
        return None
    if cfg._target_ is not None:
        from hydra.utils import get_object

        env = get_object(cfg._target_)(**cfg.kwargs)
    else:
        env = ENVIRONMENTS[cfg.name](cfg)
    if cfg.tool_free_share > 0 and not isinstance(env, DetectsCalls):
        from grpo_run.config.validation import ConfigError

        raise ConfigError(
            f"env.tool_free_share={cfg.tool_free_share!r}: the environment {cfg._target_ or cfg.name!r} "
            f"({type(env).__name__}) cannot tell a tool call without running it; give it a "
            "`calls_tool(example, turns) -> bool` method (grpo_run.envs.base.DetectsCalls) or set 0"
        )
    return env
