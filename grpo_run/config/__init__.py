"""Typed configuration: schemas, ConfigStore registration, conversion and validation."""

from grpo_run.config.convert import to_config
from grpo_run.config.schema import Config
from grpo_run.config.store import register_configs
from grpo_run.config.validation import ConfigError, validate

__all__ = ["Config", "ConfigError", "register_configs", "to_config", "validate"]
