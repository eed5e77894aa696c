"""Checks of the loaded records against the run: enough of them for a step, and prompts that fit the model.

Both run after the data loads and before any model does (the prompt check needs only the tokenizer and
the model's config), so a bad file costs seconds, never an allocation for a prompt the model cannot take.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from grpo_run.data.example import DataError, Example


def check_record_count(examples: Sequence[Example], *, batch_size: int, where: str) -> None:
    """A step draws `trainer.prompts_per_step` distinct records: fewer is an error naming the file."""
    if len(examples) < batch_size:
        raise DataError(
            f"{where}: {len(examples)} usable training records, fewer than "
            f"trainer.prompts_per_step={batch_size} (a step draws that many distinct records); "
            "give more records or lower trainer.prompts_per_step"
        )


@dataclass(frozen=True)
class PromptFit:
    kept: list[Example]
    skipped: int
    first_skipped: str | None  # the first skipped record's id (file stem:line for JSONL files)
    longest: int  # prompt tokens of the longest record seen


def fit_prompts(
    examples: Sequence[Example],
    *,
    count_tokens: Callable[[list[Example]], list[int]],
    max_positions: int | None,
    max_new_tokens: int,
    max_prompt_tokens: int | None,
    where: str,
    prompt_key: str = "data.max_prompt_tokens",
    new_tokens_key: str = "generation.max_new_tokens",
) -> PromptFit:
    """Keep the records whose chat-formatted prompt plus `max_new_tokens` fits the model's positions (and
    `data.max_prompt_tokens`, when set). Over the model's limit without `data.max_prompt_tokens`: an error
    naming the first such record; with it set, such records are skipped and counted. The messages name
    the keys the caller passes (an eval set's own `eval.datasets.<name>.max_prompt_tokens`, ...)."""
    model_limit = None if max_positions is None else max_positions - max_new_tokens
    if model_limit is not None and model_limit < 1:
        raise DataError(
            f"{new_tokens_key}={max_new_tokens} leaves no room for a prompt in the model's "
            f"{max_positions} positions"
        )
    if max_prompt_tokens is not None and model_limit is not None and max_prompt_tokens > model_limit:
        raise DataError(
            f"{prompt_key}={max_prompt_tokens} exceeds what the model can take: {max_positions} "
            f"positions - {new_tokens_key}={max_new_tokens} = {model_limit}"
        )
    limits = [x for x in (model_limit, max_prompt_tokens) if x is not None]
    if not limits:
        return PromptFit(list(examples), 0, None, 0)
    limit = min(limits)
    lengths = count_tokens(list(examples))  # each record's chat-formatted prompt
    kept = [e for e, n in zip(examples, lengths, strict=True) if n <= limit]
    over = [(e, n) for e, n in zip(examples, lengths, strict=True) if n > limit]
    if over and max_prompt_tokens is None:
        example, n = over[0]
        raise DataError(
            f"{where}: {len(over)} of {len(examples)} records have prompts too long for the model: record "
            f"{example.id} has {n} prompt tokens, + {new_tokens_key}={max_new_tokens} > the model's "
            f"{max_positions} positions; set {prompt_key}={limit} (or lower) to skip such records"
        )
    return PromptFit(kept, len(over), over[0][0].id if over else None, max(lengths, default=0))
