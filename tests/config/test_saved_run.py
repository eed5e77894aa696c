"""mode=eval of a run dir: the run's own model settings, unless the eval command line sets them."""

from pathlib import Path

import yaml
from omegaconf import OmegaConf

from grpo_run.config.saved_run import checkpoint_model_settings, command_line_model_keys, run_dir_of
from grpo_run.config.schema import DType, ModelConfig, ModelKind

# What `grpo-run model=smollm2-135m` configures (the default group) and what a tiny run saved.
SMOLLM2 = ModelConfig(kind=ModelKind.SMOLLM2, autocast_bf16=True, attn_implementation="eager", cache_dir="/c")
TINY = ModelConfig(kind=ModelKind.TINY, dtype=DType.FLOAT32, autocast_bf16=False, cache_dir="/c")


def _trained_run(root: Path, model: ModelConfig) -> Path:
    run = root / "train"
    (run / "final").mkdir(parents=True)
    (run / "final" / "config.json").write_text("{}")
    (run / "config_resolved.yaml").write_text(OmegaConf.to_yaml({"model": OmegaConf.structured(model)}))
    return run


def _eval_run(root: Path, overrides: list[str]) -> str:
    run = root / "eval"
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    return str(run)


def test_the_runs_own_model_settings_by_default(tmp_path):
    run = _trained_run(tmp_path, TINY)
    eval_dir = _eval_run(tmp_path, ["mode=eval", f"eval.checkpoint={run}"])
    model, line = checkpoint_model_settings(run / "final", SMOLLM2, eval_dir)
    assert model.kind is ModelKind.PRETRAINED and model.path == str(run / "final")
    assert model.autocast_bf16 is False and model.attn_implementation is None  # the tiny run's, not SmolLM2's
    assert "autocast_bf16=False" in line and str(run / "config_resolved.yaml") in line


def test_a_model_key_on_the_eval_command_line_wins(tmp_path):
    run = _trained_run(tmp_path, TINY)
    eval_dir = _eval_run(tmp_path, ["mode=eval", "model.autocast_bf16=true"])
    model, line = checkpoint_model_settings(run / "final", SMOLLM2, eval_dir)
    assert model.autocast_bf16 is True  # the command line's
    assert model.attn_implementation is None  # the run's
    assert "command line: autocast_bf16" in line


def test_a_model_group_choice_on_the_eval_command_line_wins(tmp_path):
    run = _trained_run(tmp_path, TINY)
    model, line = checkpoint_model_settings(
        run / "final", SMOLLM2, _eval_run(tmp_path, ["model=smollm2-135m"])
    )
    assert model.autocast_bf16 is True and model.attn_implementation == "eager"
    assert model.kind is ModelKind.PRETRAINED and "this command line" in line


def test_a_bare_model_folder_keeps_the_configured_settings(tmp_path):
    folder = tmp_path / "some_model"
    folder.mkdir()
    assert run_dir_of(folder) is None
    model, line = checkpoint_model_settings(folder, SMOLLM2, _eval_run(tmp_path, []))
    assert model.autocast_bf16 is True and model.path == str(folder) and "configured model group" in line


def test_command_line_model_keys():
    assert command_line_model_keys("/nonexistent") == set()
