"""Examples → chat prompts → token ids: one way for training and evaluation alike.

A plain question (an Example without messages, or a bare string) becomes: `data.system_prompt` (a system
turn, when set), the `data.few_shot` turns, then the question in `data.prompt_template`. A conversational
example (`data.messages_field`) is its own turns as the dataset gave them: `data.system_prompt` is put
first only when they hold no system turn, and `prompt_template` and `few_shot` do not apply.
"""

import re
from collections.abc import Sequence

import torch
from transformers import PreTrainedTokenizerBase

from grpo_run.config.checks.base import ConfigError
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


# A placeholder of distill.teacher_context: {name}.
PLACEHOLDER = re.compile(r"\{(\w+)\}")


class TeacherContextError(ConfigError):
    """distill.teacher_context names a placeholder the example cannot fill (exit 2, a config error)."""


def teacher_messages(data: DataConfig, item: Example, context: str) -> list[dict[str, str]]:
    """Self-distillation's teacher prompt: the student's chat turns (`chat_messages`) with the last user
    turn's content replaced by `context` filled in: {prompt} is that turn's content, {question} and
    {answer} the example's, any other {name} the record's column of that name."""
    turns = chat_messages(data, item)
    last = max(i for i, t in enumerate(turns) if t["role"] == "user")
    values = {str(k): str(v) for k, v in item.columns.items()}
    values.update(prompt=turns[last]["content"], question=item.question, answer=item.answer)

    def fill(match: re.Match) -> str:
        name = match.group(1)
        if name not in values:
            raise TeacherContextError(
                f"distill.teacher_context={context!r}: the placeholder {{{name}}} is none of prompt, "
                f"question, answer or a column of record {item.id!r} ({', '.join(sorted(item.columns))})"
            )
        return values[name]

    # One pass over the template: text a value brings in is never read as a placeholder.
    turns[last] = {"role": "user", "content": PLACEHOLDER.sub(fill, context)}
    return turns


def encode_teacher_prompts(
    tokenizer: PreTrainedTokenizerBase,
    data: DataConfig,
    items: Sequence[Example],
    context: str,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [B, P'], mask [B, P']) of self-distillation's teacher prompts (`teacher_messages`), left-padded."""
    texts = [
        tokenizer.apply_chat_template(
            teacher_messages(data, item, context), tokenize=False, add_generation_prompt=True
        )
        for item in items
    ]
    enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    return enc.input_ids.to(device), enc.attention_mask.to(device)


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
