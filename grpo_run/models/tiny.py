"""A ~100k-parameter Qwen2 model and a byte-level BPE tokenizer with a chat template, built in code.

Nothing is downloaded. The tokenizer is trained on a small built-in corpus with Qwen2's own
normalizer, pre-tokenizer and decoder, and saved with `tokenizer_class: PreTrainedTokenizerFast`
so that `AutoTokenizer` reloads exactly this tokenizer (for model_type qwen2 it would otherwise
swap in Qwen2Tokenizer) and gives identical ids. The folder is built once, atomically, and cached.
"""

import json
import os
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from grpo_run.models.model_cache import ensure_model_folder

TINY_VERSION = "tiny-qwen2-v1"
VOCAB_SIZE = 512
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Qwen2's pre-tokenizer split: contractions, letters, single digits, punctuation runs, spaces.
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _corpus() -> list[str]:
    words = (
        "what is the answer of plus minus times give final boxed a an and he she has buys more "
        "apples books how many does have now total left each sum number question solve step so"
    ).split()
    lines = [" ".join(words[i : i + 7]) for i in range(0, len(words), 3)]
    lines += [f"What is {a} + {b}? \\boxed{{{a + b}}}" for a in range(0, 100, 7) for b in range(0, 100, 11)]
    lines += ["<|im_start|>system\nYou are a helpful assistant.<|im_end|>", "<|im_start|>user\n", "aaaa bbbb"]
    return lines


def build_tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.padding_side = "left"
    return fast


def tiny_config(eos_token_id: int | None = None, pad_token_id: int | None = None) -> Qwen2Config:
    """The tiny model's shapes, without weights (mode=plan reads them from here)."""
    return Qwen2Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=48,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        bos_token_id=None,
    )


def build_model(tokenizer: PreTrainedTokenizerFast, seed: int = 0) -> Qwen2ForCausalLM:
    config = tiny_config(tokenizer.eos_token_id, tokenizer.pad_token_id)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def write_tiny_model(out: Path) -> None:
    """Build the tokenizer and model and save them as a transformers folder in `out`."""
    tokenizer = build_tokenizer()
    build_model(tokenizer).save_pretrained(out)
    tokenizer.save_pretrained(out)
    # Keep AutoTokenizer on this exact tokenizer (see the module docstring).
    cfg_path = out / "tokenizer_config.json"
    tok_cfg = json.loads(cfg_path.read_text())
    tok_cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(tok_cfg, indent=2))


def ensure_tiny_model(cache_dir: str | os.PathLike) -> Path:
    """Return the cached tiny-model folder, building it first if absent (atomically)."""
    return ensure_model_folder(cache_dir, TINY_VERSION, write_tiny_model)
