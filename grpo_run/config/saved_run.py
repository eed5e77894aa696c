"""`mode=eval eval.checkpoint=<run dir>`: evaluate a run's model with the model settings it trained with.

A run dir holds `config_resolved.yaml` (written at its start) and `final/`. Its `model` section (dtype,
bf16 autocast, attention) decides the numbers an evaluation gets, so it is the default; a `model=...`
choice or a `model.<key>=...` override on the eval command line still wins. What the eval command line
set is read from the eval run's own `.hydra/overrides.yaml`, which Hydra writes before the job starts.
"""

import dataclasses
from dataclasses import replace
from pathlib import Path

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from grpo_run.config.schema import ModelConfig, ModelKind

SAVED_CONFIG = "config_resolved.yaml"
WHOLE_GROUP = "*"  # `model=<option>` on the command line: the eval run's own model group, every key


def run_dir_of(folder: Path) -> Path | None:
    """The run dir that produced a model folder: the folder itself (a run dir) or the parent of its final/."""
    for candidate in (folder, folder.parent if folder.name == "final" else None):
        if candidate is not None and (candidate / SAVED_CONFIG).is_file():
            return candidate
    return None


def saved_model_config(run_dir: Path) -> ModelConfig | None:
    """The `model` section a run trained with, typed; None when its file has none or does not fit the schema."""
    saved = OmegaConf.load(run_dir / SAVED_CONFIG)
    if "model" not in saved:
        return None
    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), saved.model))
    except OmegaConfBaseException:
        return None


def command_line_model_keys(eval_run_dir: str) -> set[str]:
    """The `model.*` keys the eval command line set ({WHOLE_GROUP} for a `model=` choice)."""
    path = Path(eval_run_dir) / ".hydra" / "overrides.yaml"
    overrides = yaml.safe_load(path.read_text()) if path.is_file() else None
    keys: set[str] = set()
    for override in overrides or []:
        key = str(override).split("=", 1)[0].lstrip("+~")
        if key == "model":
            keys.add(WHOLE_GROUP)
        elif key.startswith("model."):
            keys.add(key.removeprefix("model.").split(".", 1)[0])
    return keys


def checkpoint_model_settings(
    folder: Path, configured: ModelConfig, eval_run_dir: str
) -> tuple[ModelConfig, str]:
    """The model config to load `folder` with, and one line saying where its settings came from."""
    run_dir = run_dir_of(folder)
    saved = saved_model_config(run_dir) if run_dir is not None else None
    overridden = command_line_model_keys(eval_run_dir)
    if saved is None or WHOLE_GROUP in overridden:
        source = "the model group of this command line" if saved is not None else "the configured model group"
        chosen = configured
    else:
        keep = {
            f.name: getattr(configured, f.name)
            for f in dataclasses.fields(ModelConfig)
            if f.name in overridden
        }
        chosen = replace(saved, **keep)
        source = f"{run_dir / SAVED_CONFIG}" + (f", command line: {', '.join(sorted(keep))}" if keep else "")
    model = replace(chosen, kind=ModelKind.PRETRAINED, path=str(folder))
    if not isinstance(model.autocast_bf16, bool):  # a saved "auto": the door resolved this run's own for here
        model = replace(model, autocast_bf16=configured.autocast_bf16)
    settings = (
        f"dtype={model.dtype.value} autocast_bf16={model.autocast_bf16} "
        f"attn_implementation={model.attn_implementation}"
    )
    return model, f"model settings: {settings} (from {source})"
