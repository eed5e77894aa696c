"""The door: a composed DictConfig becomes one typed `Config`, validated, before anything loads."""

import dataclasses
import difflib

from omegaconf import DictConfig, ListConfig, OmegaConf

from grpo_run.config.schema import Config
from grpo_run.config.validation import ConfigError, validate


def _reject_unknown_keys(node: object, path: str) -> None:
    """`+group.key=...` can add a key the schema lacks; refuse it rather than drop it silently."""
    if isinstance(node, ListConfig):
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
                close = difflib.get_close_matches(str(key), sorted(known), n=3, cutoff=0.6)
                hint = f"; did you mean {' or '.join(path + c for c in close)}?" if close else ""
                raise ConfigError(
                    f"{path}{key}: unknown key (known in {path or 'the root'}: {sorted(known)}){hint}"
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
    validate(config)
    return config
