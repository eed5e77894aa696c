"""Model paths from a ModelConfig: a config made in Python without OmegaConf keeps the cache folder's
interpolation as text, which must be refused by name, not created as a folder called "${oc.env:…"."""

import json
import os

import pytest
import torch
from transformers import Qwen2ForCausalLM

from grpo_run.config.schema import ModelConfig, ModelKind
from grpo_run.models.loading import (
    ModelLoadError,
    load_model,
    load_tokenizer,
    model_config,
    resolve_model_path,
)
from tests.builders import folder_with_own_code


@pytest.mark.parametrize("kind", [ModelKind.TINY, ModelKind.SMOLLM2])
def test_an_unresolved_cache_dir_is_refused_and_nothing_is_created(tmp_path, monkeypatch, kind):
    monkeypatch.chdir(tmp_path)
    cfg = ModelConfig(kind=kind)  # the schema's default: "${oc.env:GRPO_RUN_CACHE,...}"
    with pytest.raises(ModelLoadError, match=r"model\.cache_dir is an unresolved interpolation"):
        resolve_model_path(cfg)
    assert os.listdir(tmp_path) == []


def test_a_resolved_cache_dir_builds_the_tiny_model_there(tmp_path):
    path = resolve_model_path(ModelConfig(kind=ModelKind.TINY, cache_dir=str(tmp_path)))
    assert os.path.isfile(os.path.join(path, "config.json")) and path.startswith(str(tmp_path))


# ------------------------------------------------------------------------- a model folder's own code


def test_a_known_model_type_with_an_auto_map_loads_the_built_in_classes_and_says_so_once(tmp_path, capsys):
    folder, marker = folder_with_own_code(tmp_path)
    cfg = ModelConfig(kind=ModelKind.PRETRAINED, path=str(folder))
    assert model_config(cfg).model_type == "qwen2"
    tokenizer = load_tokenizer(cfg)
    policy = load_model(cfg, torch.device("cpu"), trainable=True)
    reference = load_model(cfg, torch.device("cpu"), trainable=False)
    assert not marker.exists()  # evil.py was never imported
    assert type(policy) is Qwen2ForCausalLM and type(reference) is Qwen2ForCausalLM
    assert type(tokenizer).__module__.startswith("transformers.")
    said = [line for line in capsys.readouterr().err.splitlines() if "is ignored" in line]
    assert len(said) == 1, said  # one line for the folder, however many loads read it
    assert str(folder.resolve()) in said[0] and "auto_map" in said[0] and "'qwen2'" in said[0]
    assert "trust_remote_code" not in said[0]  # nothing suggests running the folder's code


@pytest.mark.parametrize("model_type", ["grpo_run_unknown_arch", None])
def test_a_model_type_only_the_folders_code_defines_is_refused_naming_the_folder_and_key(
    tmp_path, model_type
):
    folder, marker = folder_with_own_code(tmp_path, model_type="grpo_run_unknown_arch")
    if model_type is None:
        config = json.loads((folder / "config.json").read_text())
        del config["model_type"]
        (folder / "config.json").write_text(json.dumps(config))
    cfg = ModelConfig(kind=ModelKind.PRETRAINED, path=str(folder))
    for load in (model_config, load_tokenizer, lambda c: load_model(c, torch.device("cpu"), trainable=True)):
        with pytest.raises(ModelLoadError) as err:
            load(cfg)
        assert str(folder.resolve()) in str(err.value) and "config.json auto_map" in str(err.value)
        assert (repr(model_type) if model_type else "no model_type") in str(err.value)
    assert not marker.exists()
