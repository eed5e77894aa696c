"""OmegaConf glue: a config names an Enum member by its value, as users write it.

OmegaConf converts a string to an Enum by member *name* (`AdvantageMode["NORMALIZED"]`), while YAML files
and overrides write values (`normalized`). The Enums themselves stay plain `StrEnum`s (`grpo_run/algo`
imports no config library); this module teaches OmegaConf's Enum node to fall back to the value, once,
when the schema is imported.
"""

from enum import Enum, StrEnum

from omegaconf.errors import ValidationError
from omegaconf.nodes import EnumNode

_BY_NAME = EnumNode.validate_and_convert_to_enum


def _by_name_or_value(enum_type: type[Enum], value: object) -> Enum:
    try:
        return _BY_NAME(enum_type, value)
    except ValidationError:
        if isinstance(value, str) and issubclass(enum_type, StrEnum):
            try:
                return enum_type(value)
            except ValueError:
                pass
        raise


def accept_enum_values() -> None:
    """Install the by-value fallback in OmegaConf's Enum node (idempotent)."""
    EnumNode.validate_and_convert_to_enum = staticmethod(_by_name_or_value)
