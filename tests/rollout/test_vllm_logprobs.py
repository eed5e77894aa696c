"""generation=vllm's log-probs under truncated sampling, checked on the arguments the engine gives vLLM
(no vLLM needed: a stand-in module records them; tests/integration/test_vllm.py runs the real engine).

vLLM's processed log-probs are renormalised over the tokens min_p / top-k / top-p kept: log(p_i / Z), while
the trainer's pi_old is log p_i, so their ratio would carry the kept mass Z (TRL #6789). The engine asks
for the log-probs of the full tempered distribution instead: processed ones when nothing is dropped, raw
ones (the model's own log-softmax) when something is at temperature 1; other temperatures are refused by
the config checks wherever those log-probs weigh the update."""

import sys
import types
from dataclasses import replace

import pytest
import torch

import grpo_run.models.loading as loading
import grpo_run.rollout.vllm_engine as vllm_engine
from grpo_run.config import ConfigError
from grpo_run.config.checks.generation import validate_vllm_logprobs
from grpo_run.config.schema import GenerationEngineKind, RolloutMode
from grpo_run.rollout.generate import SamplingParams
from grpo_run.rollout.vllm_engine import VLLMEngine, VLLMSettings, engine_logprobs_mode
from tests.builders import compose_config


@pytest.mark.parametrize(
    ("knobs", "mode"),
    [
        (dict(temperature=0.7, top_k=0, top_p=1.0, min_p=0.0), "processed_logprobs"),  # nothing dropped
        (dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0), "processed_logprobs"),
        (dict(temperature=1.0, top_k=0, top_p=0.8, min_p=0.0), "raw_logprobs"),
        (dict(temperature=1.0, top_k=20, top_p=1.0, min_p=0.0), "raw_logprobs"),
        (dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.1), "raw_logprobs"),
        # No vLLM mode is exact here (raw is untempered, processed renormalised): the config checks refuse
        # it where the log-probs weigh the update.
        (dict(temperature=0.7, top_k=0, top_p=0.8, min_p=0.0), "processed_logprobs"),
    ],
)
def test_the_logprobs_mode_gives_the_full_tempered_distribution(knobs, mode):
    assert engine_logprobs_mode(**knobs) == mode


def fake_vllm(monkeypatch) -> dict:
    """A stand-in `vllm` module: LLM(**kwargs) and SamplingParams(**kwargs) record their arguments."""
    seen: dict = {}
    module = types.ModuleType("vllm")
    module.LLM = lambda **kwargs: seen.setdefault("llm", kwargs)
    module.SamplingParams = lambda **kwargs: kwargs
    monkeypatch.setitem(sys.modules, "vllm", module)
    return seen


def settings(**kwargs) -> VLLMSettings:
    # device cuda: the CPU backend's head-size check would refuse this stand-in model before vLLM is imported
    base = dict(
        model_path="unused", dtype=torch.float32, seed=0, max_model_len=64, eos_id=1, pad_id=0,
        device=torch.device("cuda"),
    )  # fmt: skip
    return VLLMSettings(**{**base, **kwargs})


def policy():
    config = types.SimpleNamespace(
        hidden_size=64, num_attention_heads=2, head_dim=None, tie_word_embeddings=False
    )
    return types.SimpleNamespace(config=config)


def test_the_engine_passes_its_logprobs_mode_and_min_p_to_vllm(monkeypatch):
    seen = fake_vllm(monkeypatch)
    engine = VLLMEngine(policy(), settings(logprobs_mode="raw_logprobs"))
    assert seen["llm"]["logprobs_mode"] == "raw_logprobs"
    sampled = engine._sampling_params(SamplingParams(8, temperature=1.0, top_p=0.8, top_k=5, min_p=0.1), 4, 3)
    assert (sampled["top_p"], sampled["top_k"], sampled["min_p"], sampled["logprobs"]) == (0.8, 5, 0.1, 0)
    greedy = engine._sampling_params(SamplingParams(8, top_p=0.8, min_p=0.1, greedy=True), 1, None)
    assert (greedy["top_p"], greedy["min_p"], greedy["logprobs"]) == (1.0, 0.0, None)


@pytest.mark.parametrize(
    ("overrides", "mode"),
    [
        ([], "processed_logprobs"),  # the default run: temperature 0.7, nothing dropped
        (["generation.temperature=1.0", "generation.top_p=0.8"], "raw_logprobs"),
        (["generation.temperature=1.0", "generation.min_p=0.05"], "raw_logprobs"),
    ],
)
def test_the_run_builds_its_engine_with_the_mode_of_its_sampling(monkeypatch, overrides, mode):
    cfg = compose_config(["model=tiny", "generation.vllm.max_model_len=64", *overrides])
    built: dict = {}
    monkeypatch.setattr(vllm_engine, "VLLMEngine", lambda policy, s, **kw: built.setdefault("settings", s))
    monkeypatch.setattr(loading, "resolve_model_path", lambda model_cfg: "unused")
    tokenizer = types.SimpleNamespace(eos_token_id=1, pad_token_id=0)
    vllm_engine.build_vllm_engine(cfg, cfg.model, None, tokenizer, [], torch.device("cpu"), 0, lora=False)
    assert built["settings"].logprobs_mode == mode


def vllm_config(*overrides: str):
    """A run's typed config with generation=vllm set after composing (its package check needs vllm)."""
    cfg = compose_config(list(overrides))
    return replace(cfg, generation=replace(cfg.generation, engine=GenerationEngineKind.VLLM))


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["generation.top_p=0.9"], "generation.top_p"),  # temperature 0.7, grpo.rollout_correction on
        (["generation.top_k=20"], "generation.top_k"),
        (
            ["generation.min_p=0.05", "grpo.rollout_correction=none", "grpo.off_policy_loss=bypass"],
            "generation.min_p",
        ),
        (
            ["generation.top_p=0.9", "grpo.rollout_correction=none", "grpo.off_policy_mask_threshold=0.5"],
            "generation.top_p",
        ),
    ],
)
def test_truncation_at_another_temperature_is_refused_where_the_logprobs_weigh_the_update(overrides, key):
    with pytest.raises(ConfigError, match=rf"{key}=.*kept mass"):
        validate_vllm_logprobs(vllm_config(*overrides))


def test_truncation_is_allowed_where_vllm_has_the_exact_logprobs_or_nothing_uses_them():
    validate_vllm_logprobs(vllm_config("generation.top_p=0.9", "generation.temperature=1.0"))
    validate_vllm_logprobs(
        vllm_config("generation.top_p=0.9", "grpo.rollout_correction=none")
    )  # metrics only
    validate_vllm_logprobs(vllm_config("generation.temperature=0.5"))  # nothing dropped
    cfg = vllm_config("generation.top_p=0.9", "grpo.rollout_correction=none")
    with pytest.raises(ConfigError, match="rollout=async"):  # the off-policy loss's behaviour policy
        validate_vllm_logprobs(replace(cfg, rollout=replace(cfg.rollout, mode=RolloutMode.ASYNC)))
