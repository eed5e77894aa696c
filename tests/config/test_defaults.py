"""One place for each default: a value the user gets without overrides comes either from the schema
(grpo_run/config/schema.py) or from the group option the defaults list chooses, never from both, and
conf/config.yaml itself sets no value."""

import dataclasses
from pathlib import Path

from omegaconf import OmegaConf

from grpo_run.cli import CONF_DIR
from grpo_run.config import register_configs, schema
from tests.builders import compose_config

register_configs()
CONF = Path(CONF_DIR)


def schema_default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    raise AssertionError(f"{f.name} has no default")


def differences(obj, cls, prefix: str = "") -> dict[str, object]:
    """Dotted key -> the composed value, for every field whose value is not the schema's default."""
    out: dict[str, object] = {}
    for f in dataclasses.fields(cls):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            out.update(differences(value, type(value), f"{prefix}{f.name}."))
            continue
        default = schema_default(f)
        if isinstance(default, str) and "${" in default:
            continue  # an interpolation: equal to what it points at, by construction
        if value != default:
            out[prefix + f.name] = value
    return out


def chosen_options() -> dict[str, str]:
    """The defaults list's group choices (`- model: smollm2-135m`), by group."""
    defaults = OmegaConf.load(CONF / "config.yaml").defaults
    return {
        group: option
        for entry in defaults
        if OmegaConf.is_dict(entry)
        for group, option in entry.items()
        if option is not None and not group.startswith("override ")
    }


def keys_set_by(group: str, option: str) -> set[str]:
    """Dotted keys the option's YAML writes (following its own defaults list), under the group's package."""
    node = OmegaConf.load(CONF / group / f"{option}.yaml")
    keys: set[str] = set()
    for entry in node.pop("defaults", []):
        keys |= keys_set_by(group, entry) if isinstance(entry, str) and entry != "_self_" else set()
    for key in flat_keys(OmegaConf.to_container(node)):
        keys.add(key if group in ("advantage_mode", "std_correction", "aggregation") else f"{group}.{key}")
    return keys


def flat_keys(tree: dict, prefix: str = "") -> set[str]:
    keys: set[str] = set()
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            keys |= flat_keys(value, f"{prefix}{key}.")
        else:
            keys.add(prefix + key)
    return keys


def test_config_yaml_sets_no_value_only_the_defaults_list():
    top = OmegaConf.load(CONF / "config.yaml")
    assert set(top) == {"defaults", "hydra"}


def test_every_default_comes_from_the_schema_or_the_chosen_option():
    cfg = compose_config([])
    set_by_groups = set()
    for group, option in chosen_options().items():
        set_by_groups |= keys_set_by(group, option)
    # advantage_mode etc. write grpo's field from a group of their own
    set_by_groups = {f"grpo.{k}" if "." not in k else k for k in set_by_groups}
    elsewhere = {
        key: value for key, value in differences(cfg, schema.Config).items() if key not in set_by_groups
    }
    assert elsewhere == {}
    # the group choices that matter most, as the user gets them
    assert (cfg.model.kind, cfg.grpo.group_size, cfg.generation.temperature) == ("smollm2", 8, 0.7)
    assert (cfg.trainer.lr, cfg.trainer.lr_scheduler, cfg.trainer.max_steps) == (3e-5, "linear", 32)


def test_the_model_kind_has_no_schema_default():
    kind = next(f for f in dataclasses.fields(schema.ModelConfig) if f.name == "kind")
    assert kind.default == "???"  # the defaults list's model group always sets it
