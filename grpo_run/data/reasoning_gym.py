"""Procedurally generated verifiable tasks from reasoning-gym (an optional extra: pip install grpo-run[reasoning-gym]).

`data=reasoning_gym data.reasoning_gym.tasks=[leg_counting, chain_sum]` draws problems offline, each task
with its own generator settings (`data.reasoning_gym.config.<task>`: the task's config fields, such as
`max_animals`). `reward=reasoning_gym` scores each completion with its task's own checker, which reads the
record's `metadata` column (every column reaches the reward functions).

Splits: each task generates `eval_size + train_size` problems (its share, the tasks interleaved in turn)
from one seed; the first `eval_size` are held out and the rest trained on, so the two never share a
generated index (reasoning-gym's generators draw each index from `seed + index`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from grpo_run.data.example import DataError, Example


def _module():
    try:
        import reasoning_gym
    except ImportError:
        raise DataError(
            "data=reasoning_gym needs the reasoning-gym package: pip install 'grpo-run[reasoning-gym]' "
            "(or pip install reasoning-gym)"
        ) from None
    return reasoning_gym


def _shares(total: int, parts: int) -> list[int]:
    """`total` split into `parts` near-equal shares, the larger ones first: 7 into 3 -> [3, 2, 2]."""
    return [total // parts + (i < total % parts) for i in range(parts)]


def reasoning_gym_splits(
    tasks: Sequence[str],
    task_config: Mapping[str, Mapping[str, Any]],
    *,
    seed: int,
    train_size: int,
    eval_size: int,
) -> tuple[list[Example], list[Example]]:
    """(train, eval) examples of the tasks, interleaved task by task (see the module docstring)."""
    rg = _module()
    if not tasks:
        raise DataError("data.reasoning_gym.tasks is empty: name at least one task (e.g. [leg_counting])")
    from reasoning_gym.factory import DATASETS

    unknown = [t for t in list(tasks) + list(task_config) if t not in DATASETS]
    if unknown:
        raise DataError(
            f"data.reasoning_gym: unknown task(s) {unknown}; reasoning-gym has {len(DATASETS)}, e.g. "
            f"{', '.join(sorted(DATASETS)[:12])}, ..."
        )
    per_task = []
    for task, n_train, n_eval in zip(
        tasks, _shares(train_size, len(tasks)), _shares(eval_size, len(tasks)), strict=True
    ):
        options = dict(task_config.get(task, {}))
        try:
            generated = rg.create_dataset(task, seed=seed, size=n_eval + n_train, **options)
        except (TypeError, ValueError, AssertionError) as err:  # a config field it lacks, or a bad value
            raise DataError(
                f"data.reasoning_gym.config.{task}={options}: {type(err).__name__}: {err}"
            ) from None
        records = [generated[i] for i in range(len(generated))]
        per_task.append((task, records[:n_eval], records[n_eval:]))
    evaluation = _interleave([(task, held) for task, held, _ in per_task], "eval")
    train = _interleave([(task, rest) for task, _, rest in per_task], "train")
    return train, evaluation


def _interleave(parts: Sequence[tuple[str, list[dict]]], split: str) -> list[Example]:
    examples = []
    longest = max((len(records) for _, records in parts), default=0)
    for i in range(longest):
        for task, records in parts:
            if i < len(records):
                examples.append(_example(records[i], f"{task}:{split}:{i}"))
    return examples


def _example(record: Mapping[str, Any], example_id: str) -> Example:
    question, answer = str(record["question"]), record.get("answer")
    return Example(
        question=question,
        answer="" if answer is None else str(answer),
        id=example_id,
        columns={"question": question, "answer": answer, "metadata": record["metadata"]},
    )
