"""Prompt sources -> examples -> batches.

``load_split`` picks a source by name (arithmetic, jsonl, gsm8k, math500) and returns a list of
``Example(question, answer, id)`` with the gold final answer; ``PromptSampler`` draws shuffled batches
from it and can be checkpointed.
"""

from grpo_run.data.arithmetic import arithmetic_splits, generate_arithmetic
from grpo_run.data.example import DataError, Example
from grpo_run.data.jsonl import AnswerFormat, LoadResult, OnBadRecord, gsm8k_final_answer, load_jsonl
from grpo_run.data.sampler import PromptSampler
from grpo_run.data.sources import DataSource, Split, load_split

__all__ = [
    "AnswerFormat",
    "DataError",
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
]
