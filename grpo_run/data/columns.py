"""Which columns the data keys map, checked against the columns a split has, with the likely key named.

A prompt column holds plain text or a conversation; a conversation is told apart as TRL's
`is_conversational` does: a list whose first item is a mapping with a "role".
"""

from collections.abc import Mapping, Sequence
from typing import Any

# The columns a prompt is most often found in, in the order the likely key is suggested.
PROMPT_COLUMNS = ("prompt", "question", "problem", "messages", "query", "instruction", "input")
CONVERSATION = "a conversation (TRL's format: a list of {role, content} turns)"


def is_conversation(value: object) -> bool:
    """A conversational prompt as TRL's `is_conversational` tells one: a list whose first item is a
    mapping with a "role" key (every turn is checked when the record is parsed)."""
    return (
        isinstance(value, Sequence)
        and not isinstance(value, (str, bytes))
        and len(value) > 0
        and isinstance(value[0], Mapping)
        and "role" in value[0]
    )


def is_text(value: object) -> bool:
    """A value a text field takes: a string or a number (not a bool)."""
    return isinstance(value, (str, int, float)) and not isinstance(value, bool)


def column_problems(
    columns: Sequence[str], first: Mapping[str, Any] | None, fields: Mapping[str, Any], where: str
) -> list[str]:
    """One line per data key that names a column `columns` lacks, or whose value in the first record
    (`first`, when there is one) cannot be what the key reads; each names the likely key. where: the
    split or file the columns are of.

    fields: parse_record's field options (question_field, messages_field, answer_field, id_field,
    entry_point_field); a key set to None is not checked."""
    problems: list[str] = []
    absent = f"is not a column of {where} (columns: {', '.join(columns)})"
    prompt_key = "messages_field" if fields.get("messages_field") else "question_field"
    prompt = fields.get(prompt_key)
    if prompt is not None:
        if prompt not in columns:
            problems.append(f"data.{prompt_key}={prompt!r} {absent}: {_prompt_hint(columns, first)}")
        elif first is not None:
            problems += _prompt_value_problems(prompt_key, prompt, first[prompt], where)
    answer = fields.get("answer_field")
    if answer is None and fields.get("answer_format") == "gsm8k":  # a GSM8K gold is always read
        answer = "answer"
        absent += " (data.answer_format=gsm8k reads data.answer_field, null: 'answer')"
    if answer is not None:
        if answer not in columns:
            hint = (
                "data.answer_field=answer"
                if "answer" in columns
                else "name the gold answer's column in data.answer_field, or data.answer_field=null "
                "(no gold answer: your reward reads the columns it needs)"
            )
            problems.append(f"data.answer_field={answer!r} {absent}: {hint}")
        elif first is not None and not is_text(first[answer]):
            problems.append(
                f"data.answer_field={answer!r}: the column in {where} holds {type(first[answer]).__name__}, "
                "not text or a number: name another column, or data.answer_field=null (no gold answer)"
            )
    for key, instead in (
        ("id_field", "data.id_field=null (ids: <dataset>:<split>:<row>, or <file>:<line>)"),
        ("entry_point_field", "name the column holding the function's name"),
    ):
        name = fields.get(key)
        if name is not None and name not in columns:
            problems.append(f"data.{key}={name!r} {absent}: {instead}")
    return problems


def _prompt_hint(columns: Sequence[str], first: Mapping[str, Any] | None) -> str:
    for name in PROMPT_COLUMNS:
        if name in columns:
            return f"data.question_field={name}"
    if first is not None:
        for name in columns:
            if is_conversation(first[name]):
                return f"data.question_field={name}"
    return "name the prompt's column (text or a conversation) in data.question_field"


def _prompt_value_problems(key: str, name: str, value: object, where: str) -> list[str]:
    if is_conversation(value) or (key == "question_field" and is_text(value)):
        return []
    holds = f"data.{key}={name!r}: the column in {where} holds"
    if key == "messages_field" and is_text(value):
        return [
            f"{holds} text, not {CONVERSATION}: data.question_field={name} data.messages_field=null reads "
            "a text prompt"
        ]
    if key == "messages_field":
        return [f"{holds} {_shape(value)}, not {CONVERSATION}"]
    return [
        f"{holds} {_shape(value)}, neither text nor {CONVERSATION}; a conversational prompt, in "
        "data.question_field or data.messages_field, is such a list"
    ]


def _shape(value: object) -> str:
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        first = f", first item {value[0]!r:.60}" if value else ", empty"
        return f"a list{first}"
    return type(value).__name__
