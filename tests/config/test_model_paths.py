"""A model path key names an existing folder or could be a hub id; anything else is a config error naming
that exact key and the value, at the door. A hub id that does not load names its own key in the hint."""

import re

import pytest

from grpo_run.config import ConfigError
from grpo_run.config.checks.model import is_hub_id
from grpo_run.models.loading import ModelLoadError
from grpo_run.run_context import check_teacher_tokenizer
from tests.builders import compose_config

# Each model path key, with the overrides that make it read.
KEYS = {
    "model.path": ["model=local"],
    "distill.teacher.path": ["model=tiny", "distill=teacher"],
    "reward.functions[0].model.path": ["reward=reward_model"],
}


def _override(key: str, value: str) -> str:
    return f"{key.replace('[0]', '.0')}='{value}'"  # quoted: Hydra's grammar takes `~` and spaces so


@pytest.mark.parametrize("key", KEYS)
@pytest.mark.parametrize(
    "value",
    [
        "/no/such/folder",  # absolute: a folder or nothing
        "./no-such-folder",
        "~/no-such-folder-grpo-run",
        "runs/2025/final",  # three parts: no hub id has them
        "org/name with spaces",
        "org--name/x",
    ],
)
def test_a_path_that_is_no_folder_and_no_hub_id_exits_naming_its_key(key, value):
    with pytest.raises(ConfigError, match=re.escape(f"{key}={value!r}: names no folder")):
        compose_config([*KEYS[key], _override(key, value)])


@pytest.mark.parametrize("key", KEYS)
def test_a_file_is_no_model(key, tmp_path):
    file = tmp_path / "model.safetensors"
    file.write_bytes(b"")
    with pytest.raises(ConfigError, match=re.escape(f"{key}={str(file)!r}: is a file")):
        compose_config([*KEYS[key], _override(key, str(file))])


@pytest.mark.parametrize("key", KEYS)
@pytest.mark.parametrize("value", ["HuggingFaceTB/SmolLM2-135M-Instruct", "gpt2", "org_1/model.v2-final"])
def test_a_plausible_hub_id_passes_the_door(key, value):
    compose_config([*KEYS[key], _override(key, value)])  # whether it exists shows when it loads


def test_an_existing_folder_passes_the_door(tmp_path):
    (tmp_path / "config.json").write_text("{}")  # a reward model's folder needs its config.json
    for key, overrides in KEYS.items():
        compose_config([*overrides, _override(key, str(tmp_path))])


def test_hub_id_shapes():
    assert is_hub_id("Qwen/Qwen2.5-0.5B-Instruct") and is_hub_id("gpt2")
    for bad in ("/abs", "./rel", "~/home", "a/b/c", "-lead/x", "org/x.", "a..b", "", "org/"):
        assert not is_hub_id(bad), bad


def test_a_teacher_hub_id_that_does_not_load_names_the_teachers_key(tmp_path):
    """Offline (HF_HUB_OFFLINE=1, tests/conftest.py), an id the cache lacks fails when the teacher's
    tokenizer loads; the hint says which key to point at a folder, not model.path."""
    cfg = compose_config(
        ["model=tiny", "distill=teacher", "distill.teacher.path=no-such-org/no-such-teacher"]
    )
    with pytest.raises(ModelLoadError) as err:
        check_teacher_tokenizer(cfg, tokenizer=None)
    assert "'no-such-org/no-such-teacher'" in str(err.value)
    assert "point distill.teacher.path to a folder" in str(err.value)
    assert "model.path" not in str(err.value)
