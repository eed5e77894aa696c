"""Model paths from a ModelConfig: a config made in Python without OmegaConf keeps the cache folder's
interpolation as text, which must be refused by name, not created as a folder called "${oc.env:…"."""

import os

import pytest

from grpo_run.config.schema import ModelConfig, ModelKind
from grpo_run.models.loading import ModelLoadError, resolve_model_path


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
