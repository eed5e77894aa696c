"""Prompt sources -> examples -> batches.

``load_split`` picks a source by name (arithmetic, jsonl, hub) and returns a list of
``Example(question, answer, id, columns, messages)`` with the gold final answer; ``PromptSampler`` draws
shuffled batches from it and can be checkpointed; ``prompts`` turns examples into chat prompts.
"""

from grpo_run.data.arithmetic import arithmetic_splits, generate_arithmetic
from grpo_run.data.example import DataError, DataKeyError, Example
from grpo_run.data.jsonl import (
    RESERVED_COLUMNS,
    AnswerFormat,
    LoadResult,
    OnBadRecord,
    gsm8k_final_answer,
    load_jsonl,
)
from grpo_run.data.sampler import PromptSampler
from grpo_run.data.sources import DataSource, Split, load_split, load_splits

__all__ = [
    "RESERVED_COLUMNS",
    "AnswerFormat",
    "DataError",
    "DataKeyError",
    "DataSource",
    "Example",
    "LoadResult",
    "OnBadRecord",
    "PromptSampler",
    "Split",
    "arithmetic_splits",
    "generate_arithmetic",
    "gsm8k_final_answer",
    "load_jsonl",
    "load_split",
    "load_splits",
]
