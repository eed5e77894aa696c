"""Examples → chat prompts → token ids: one way for training and evaluation alike.

A plain question (an Example without messages, or a bare string) becomes: `data.system_prompt` (a system
turn, when set), the `data.few_shot` turns, then the question in `data.prompt_template`. A conversational
example (`data.messages_field`) is its own turns as the dataset gave them: `data.system_prompt` is put
first only when they hold no system turn, and `prompt_template` and `few_shot` do not apply.
"""

from collections.abc import Sequence

import torch
from transformers import PreTrainedTokenizerBase

from grpo_run.config.schema import DataConfig
from grpo_run.data.example import Example

# What a prompt is built from: an Example, or a plain question's text.
PromptInput = Example | str


def chat_messages(data: DataConfig, item: PromptInput) -> list[dict[str, str]]:
    """The chat turns of one prompt, before the chat template (see the module docstring)."""
    system = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
    if isinstance(item, Example) and item.messages is not None:
        turns = [{"role": m["role"], "content": m["content"]} for m in item.messages]
        has_system = any(t["role"] == "system" for t in turns)
        return turns if has_system else system + turns
    question = item.question if isinstance(item, Example) else item
    shots = [{"role": m.role, "content": m.content} for m in data.few_shot]
    return (
        system + shots + [{"role": "user", "content": data.prompt_template.replace("{question}", question)}]
    )


def chat_prompts(
    tokenizer: PreTrainedTokenizerBase, data: DataConfig, items: Sequence[PromptInput]
) -> list[str]:
    """Chat-formatted prompts ending with the assistant turn's opening."""
    return [
        tokenizer.apply_chat_template(chat_messages(data, item), tokenize=False, add_generation_prompt=True)
        for item in items
    ]


def prompt_bytes(data: DataConfig, item: PromptInput) -> int:
    """UTF-8 bytes of a prompt's turns before the chat template's markup (mode=plan's bound)."""
    return sum(len(turn["content"].encode()) for turn in chat_messages(data, item))


def encode_prompts(
    tokenizer: PreTrainedTokenizerBase, data: DataConfig, items: Sequence[PromptInput], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [B, P], mask [B, P]) of the chat prompts, left-padded (the tokenizer's padding side)."""
    enc = tokenizer(
        chat_prompts(tokenizer, data, items), return_tensors="pt", padding=True, add_special_tokens=False
    )
    return enc.input_ids.to(device), enc.attention_mask.to(device)
