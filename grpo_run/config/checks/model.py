"""model: a pretrained model's path, and the bf16 autocast switch; the check every model path key shares."""

import re
from pathlib import Path

from grpo_run.config.checks.base import check, fail
from grpo_run.config.schema import Config, ModelKind

# A hub id as the hub accepts one: `name` or `owner/name`, each of word characters, '-' and '.', starting
# and ending with a word character (a name at most 96 long), without '--' or '..'.
_HUB_PART = r"\w(?:[\w.-]{0,94}\w)?"
HUB_ID = re.compile(rf"(?:{_HUB_PART}/)?{_HUB_PART}")


def is_hub_id(path: str) -> bool:
    return HUB_ID.fullmatch(path) is not None and ".." not in path and "--" not in path


def check_model_path(key: str, path: str) -> None:
    """A model path key (`model.path`, `distill.teacher.path`, a reward model's `path`) names an existing
    folder or could be a hub id; anything else is a ConfigError naming the key now, before any model
    loads. A hub id is only plausible here: whether it exists (or is cached offline) shows when it loads."""
    local = Path(path).expanduser()
    if local.is_dir():
        return
    if local.exists():
        fail(key, path, "is a file; a model is a folder (its config.json and weights) or a hub id")
    if not is_hub_id(path):
        fail(
            key,
            path,
            f"names no folder ({local.resolve()} does not exist) and is no hub id (name or owner/name, of "
            "letters, digits, '-', '_' and '.')",
        )


def autocast_setting(value: object) -> bool | str:
    """model.autocast_bf16 as True, False or "auto" (the strings "true"/"false" too); anything else fails."""
    if isinstance(value, bool):
        return value
    word = value.lower() if isinstance(value, str) else None
    if word not in ("true", "false", "auto"):
        fail("model.autocast_bf16", value, "must be true, false or auto (bf16 where the hardware has it)")
    return "auto" if word == "auto" else word == "true"


def validate_model(cfg: Config) -> None:
    if cfg.model.kind == ModelKind.PRETRAINED:
        check(
            bool(cfg.model.path),
            "model.path",
            cfg.model.path,
            "model.kind=pretrained needs a hub id or folder",
        )
        check_model_path("model.path", cfg.model.path)
    else:
        # The built-in models make their own folder: a path given with them would be silently unused.
        check(
            not cfg.model.path,
            "model.path",
            cfg.model.path,
            f"is not read with model.kind={cfg.model.kind.value} (the built-in model); for a folder or hub "
            "id of your own: model=local model.path=... (or model=pretrained)",
        )
    autocast_setting(cfg.model.autocast_bf16)
