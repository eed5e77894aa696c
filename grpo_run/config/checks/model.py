"""model: a pretrained model's path, and the bf16 autocast switch."""

from grpo_run.config.checks.base import check, fail
from grpo_run.config.schema import Config, ModelKind


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
