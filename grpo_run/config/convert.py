"""The door: a composed DictConfig becomes one typed `Config`, validated, before anything loads."""

import dataclasses
import difflib

from omegaconf import DictConfig, ListConfig, OmegaConf

from grpo_run.config.precision import resolve_config_autocast
from grpo_run.config.removed import removed_hint
from grpo_run.config.schema import Config, RewardModelKind
from grpo_run.config.trl_names import trl_hint
from grpo_run.config.validation import ConfigError, autocast_setting, validate

# The door's line on the precision it chose for model.autocast_bf16, with that choice: the run's start
# prints it (run_context.precision_line) when the config it runs is the one the door made.
_precision: tuple[bool, str] | None = None


def _reject_unknown_keys(node: object, path: str) -> None:
    """`+group.key=...` can add a key the schema lacks; refuse it rather than drop it silently."""
    if isinstance(node, ListConfig):
        if node._is_none():  # an optional list left null (reward.functions[i].range)
            return
        for i, item in enumerate(node):
            _reject_unknown_keys(item, f"{path}[{i}]")
        return
    if not isinstance(node, DictConfig):
        return
    schema = OmegaConf.get_type(node)
    if schema is not None and dataclasses.is_dataclass(schema):
        known = {f.name for f in dataclasses.fields(schema)}
        for key in node.keys():
            if key not in known:
                # a removed key (`+distill.kl_estimator=k3`) or a TRL name (`+num_generations=8`): not a typo
                hint = removed_hint(f"{path}{key}") or trl_hint(f"{path}{key}")
                if not hint:
                    close = difflib.get_close_matches(str(key), sorted(known), n=3, cutoff=0.6)
                    hint = f"did you mean {' or '.join(path + c for c in close)}?" if close else ""
                raise ConfigError(
                    f"{path}{key}: unknown key (known in {path or 'the root'}: {sorted(known)})"
                    + (f"; {hint}" if hint else "")
                )
    for key in node.keys():
        if schema is None or not dataclasses.is_dataclass(schema) or key != "kwargs":
            _reject_unknown_keys(node._get_node(key), f"{path}{key}.")


def to_config(cfg: DictConfig) -> Config:
    """Resolve interpolations, convert to the dataclass tree and validate it."""
    _reject_unknown_keys(cfg, "")
    OmegaConf.resolve(cfg)
    config = OmegaConf.to_object(cfg)
    if not isinstance(config, Config):
        raise TypeError(f"expected the grpo_run schema at the root of the config, got {type(config)}")
    for fn in config.reward.functions:  # a user's reward without a name is named for its target's last part
        if fn._target_ and not fn.name:
            fn.name = fn._target_.rpartition(".")[2]
        elif fn.model is not None and not fn.name:  # a model's, for its kind
            fn.name = model_reward_name(fn.model.kind)
    validate(config)
    global _precision
    _precision = resolve_config_autocast(config, autocast_setting(config.model.autocast_bf16))
    # Every consumer sees a plain bool, and config_resolved.yaml (written from `cfg`) records what ran.
    config.model.autocast_bf16 = cfg.model.autocast_bf16 = _precision[0]
    return config


def model_reward_name(kind: RewardModelKind) -> str:
    """The metrics' name of a model entry that gives none: reward_model (a classifier) or judge."""
    return "reward_model" if kind == RewardModelKind.CLASSIFIER else "judge"


def precision_note(autocast_bf16: bool) -> str | None:
    """The door's line for a config whose model.autocast_bf16 is `autocast_bf16`; None when the door made
    no such choice (a config built in code, or another one converted since)."""
    return _precision[1] if _precision is not None and _precision[0] == autocast_bf16 else None
