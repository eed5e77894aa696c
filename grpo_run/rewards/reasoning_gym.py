"""reasoning-gym's own checkers as a reward (`reward=reasoning_gym`; data from `data=reasoning_gym`).

Each completion's final answer (the last non-empty `\\boxed{...}`, else the text of the last
`<answer>...</answer>`, else with `fallback_last_number` the last number, else the last non-empty line) is
scored by its task's checker, found through the
record's `metadata` column (`source_dataset`); the checker's value (in [0, 1], partial credit for some
tasks) is the reward. A record without reasoning-gym metadata is unscorable (None), never 0.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from grpo_run.rewards.extract import boxed_contents, last_number

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def final_answer(completion: str, fallback_last_number: bool = False) -> str:
    """The answer a completion gives: `\\boxed{4}` -> "4"; `<answer> 4 </answer>` -> "4"; else, with
    fallback_last_number, its last number ("so 2 + 2 = 4." -> "4"); else its last line."""
    boxed = [content for content in boxed_contents(completion) if content.strip()]
    if boxed:
        return boxed[-1].strip()
    tagged = _ANSWER_TAG.findall(completion)
    if tagged:
        return tagged[-1].strip()
    number = last_number(completion) if fallback_last_number else None
    if number is not None:
        return number
    lines = [line.strip() for line in completion.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


def reasoning_gym_score(
    prompts: Sequence[Any],
    completions: Sequence[str],
    answers: Sequence[str],
    *,
    metadata: Sequence[Mapping[str, Any] | None],
    question: Sequence[str] | None = None,
    answer: Sequence[Any] | None = None,
    fallback_last_number: bool = False,
    **_: Any,
) -> list[float | None]:
    """One checker value per completion (see the module docstring); `metadata`, `question` and `answer` are
    the data's columns, one per completion. fallback_last_number: for numeric tasks (the data config's
    `data.fallback_last_number`): an unboxed completion's last number is its answer."""
    import reasoning_gym

    values: list[float | None] = []
    for i, (completion, meta) in enumerate(zip(completions, metadata, strict=True)):
        task = (meta or {}).get("source_dataset")
        if task is None:
            values.append(None)
            continue
        entry = {
            "question": question[i] if question is not None else prompts[i],
            "answer": answer[i] if answer is not None else answers[i],
            "metadata": meta,
        }
        given = final_answer(completion, fallback_last_number)
        values.append(float(reasoning_gym.get_score_answer_fn(task)(given, entry)))
    return values
