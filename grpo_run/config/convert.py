"""The door: a composed DictConfig becomes one typed `Config`, validated, before anything loads."""

from omegaconf import DictConfig, OmegaConf

from grpo_run.config.schema import Config
from grpo_run.config.validation import validate


def to_config(cfg: DictConfig) -> Config:
    """Resolve interpolations, convert to the dataclass tree and validate it."""
    OmegaConf.resolve(cfg)
    config = OmegaConf.to_object(cfg)
    if not isinstance(config, Config):
        raise TypeError(f"expected the grpo_run schema at the root of the config, got {type(config)}")
    validate(config)
    return config
