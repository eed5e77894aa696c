"""Questions → chat prompts → token ids: one way for training and evaluation alike."""

import torch
from transformers import PreTrainedTokenizerBase

from grpo_run.config.schema import DataConfig


def chat_prompts(tokenizer: PreTrainedTokenizerBase, data: DataConfig, questions: list[str]) -> list[str]:
    """Chat-formatted prompts ending with the assistant turn's opening: the system prompt, the few-shot
    turns, then the question in its template."""
    out = []
    shots = [{"role": m.role, "content": m.content} for m in data.few_shot]
    for q in questions:
        messages = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
        messages += shots
        messages.append({"role": "user", "content": data.prompt_template.replace("{question}", q)})
        out.append(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
    return out


def encode_prompts(
    tokenizer: PreTrainedTokenizerBase, data: DataConfig, questions: list[str], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [B, P], mask [B, P]) of the chat prompts, left-padded (the tokenizer's padding side)."""
    enc = tokenizer(
        chat_prompts(tokenizer, data, questions), return_tensors="pt", padding=True, add_special_tokens=False
    )
    return enc.input_ids.to(device), enc.attention_mask.to(device)
