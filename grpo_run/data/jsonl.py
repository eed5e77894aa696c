"""Load question/answer records from a JSON Lines file, with errors that name the file and line."""

import gzip
import json
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from grpo_run.config.schema import AnswerFormat, OnBadRecord
from grpo_run.data.columns import CONVERSATION, column_problems, is_conversation, is_text
from grpo_run.data.example import DataError, DataKeyError, Example


@dataclass(frozen=True)
class LoadResult:
    """The examples read from one file.

    Attributes:
        examples: the valid records, in file order.
        skipped: how many bad lines were skipped (always 0 with ``on_bad_record="error"``).
        skip_reasons: one ``"<file>:<line>: <why>"`` message per skipped line, for logging.
    """

    examples: list[Example]
    skipped: int = 0
    skip_reasons: tuple[str, ...] = field(default=())


class RecordError(ValueError):
    """One record is unusable; the caller adds where it came from."""


class ReservedColumnError(RecordError):
    """A column bears a name the reward call passes itself: the whole source is refused, never skipped."""


# The keywords a user's reward function receives beside the columns (TRL's call): a column of the same
# name could not reach it.
RESERVED_COLUMNS = ("prompts", "completions", "completion_ids", "trainer_state", "step", "completion_lengths")
CHAT_ROLES = ("system", "user", "assistant", "tool")
# The gold answer's column when data.answer_field is null and the record has one.
DEFAULT_ANSWER_COLUMN = "answer"


def reserved_column_error(columns: Collection[str], where: str) -> DataError | None:
    """A DataError naming the first reserved column among `columns` and where they come from, or None."""
    for name in columns:
        if name in RESERVED_COLUMNS:
            return DataError(
                f"{where}: column {name!r} has a name the reward call passes itself "
                f"({', '.join(RESERVED_COLUMNS)}): rename or drop the column"
            )
    return None


def gsm8k_final_answer(solution: str) -> str:
    """The gold final answer of a GSM8K solution: text after the last ``####``, commas removed.

    ``"... #### 1,234"`` -> ``"1234"``. Raises RecordError when there is no ``####`` or nothing after it.
    """
    if "####" not in solution:
        raise RecordError("GSM8K answer has no '####' final-answer marker")
    final = solution.rsplit("####", 1)[1].strip().replace(",", "")
    if not final:
        raise RecordError("GSM8K answer is empty after '####'")
    return final


def parse_record(
    record: object,
    *,
    question_field: str = "question",
    answer_field: str | None = "answer",
    answer_format: AnswerFormat | str = AnswerFormat.RAW,
    id_field: str | None = None,
    entry_point_field: str | None = None,
    messages_field: str | None = None,
    default_id: str,
) -> Example:
    """Turn one decoded record (a mapping) into an Example; raise RecordError saying what is wrong.

    Every column lands in ``Example.columns`` as given. The prompt is question_field's column, plain text
    or a conversation (told apart as TRL's `is_conversational` does, see :func:`prompt_turns`), or
    messages_field's, which must be a conversation; a conversation's question is its last user turn.
    answer_field None: the ``answer`` column when the record has one holding text or a number, else no
    gold (``answer == ""``); answer_format gsm8k always reads a column (None: ``answer``).
    entry_point_field: a code problem (HumanEval's fields): the answer field holds the test code defining
    `check(candidate)`, and the answer becomes that test followed by `check(<entry point>)`, the code the
    code_exec reward appends to the program.
    """
    if not isinstance(record, Mapping):
        raise RecordError(f"expected a JSON object, got {type(record).__name__}")
    reserved = [name for name in record if name in RESERVED_COLUMNS]
    if reserved:
        raise ReservedColumnError(
            f"column {reserved[0]!r} has a name the reward call passes itself "
            f"({', '.join(RESERVED_COLUMNS)}): rename or drop the column"
        )
    messages = None
    prompt_field = messages_field or question_field
    if messages_field is not None or is_conversation(record.get(question_field)):
        messages = prompt_turns(record, prompt_field)
        question = next(m["content"] for m in reversed(messages) if m["role"] == "user")
    else:
        question = _field_text(record, question_field, "question")
    if AnswerFormat(answer_format) is AnswerFormat.GSM8K:
        answer = gsm8k_final_answer(_field_text(record, answer_field or DEFAULT_ANSWER_COLUMN, "answer"))
    else:
        answer = _gold(record, answer_field)
    if entry_point_field is not None:
        entry_point = _field_text(record, entry_point_field, "entry point")
        if not entry_point.isidentifier():
            raise RecordError(
                f"entry point field {entry_point_field!r} is not a Python name: {entry_point!r}"
            )
        answer = f"{answer}\n\ncheck({entry_point})"
        if messages is None:  # a prompt of code keeps its whitespace
            question = str(record[question_field])
    if id_field is None:
        example_id = default_id
    else:
        if id_field not in record or record[id_field] is None:
            raise RecordError(f"missing id field {id_field!r}")
        example_id = str(record[id_field])
    return Example(question=question, answer=answer, id=example_id, columns=dict(record), messages=messages)


def _gold(record: Mapping, answer_field: str | None) -> str:
    """The gold answer's text: answer_field's column, or with None the ``answer`` column when it holds
    text or a number (a default guess: anything else there means no gold, never an error)."""
    if answer_field is not None:
        return _field_text(record, answer_field, "answer")
    value = record.get(DEFAULT_ANSWER_COLUMN)
    if not is_text(value):
        return ""
    return _field_text(record, DEFAULT_ANSWER_COLUMN, "answer") if str(value).strip() else ""


def prompt_turns(record: Mapping, key: str) -> tuple[dict[str, str], ...]:
    """A conversational prompt column (TRL's format) as role/content turns.

    A prompt column (``prompt``) holds the prompt only and ends with a user turn. A whole conversation
    (a ``messages`` column, as SFT data holds it) ends with the assistant's answer: the prompt is every
    turn before that last assistant turn. Unlike TRL, a trailing assistant turn is never continued
    (prefilled). The prompt must hold a user turn; the question is the last one's content.
    """
    if key not in record:
        raise RecordError(f"missing messages field {key!r} (keys: {sorted(record)})")
    value = record[key]
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or not value:
        raise RecordError(
            f"messages field {key!r} must be a non-empty list of {{role, content}} turns, "
            f"got {type(value).__name__}"
        )
    turns = []
    for i, turn in enumerate(value):
        role = turn.get("role") if isinstance(turn, Mapping) else None
        content = turn.get("content") if isinstance(turn, Mapping) else None
        if role not in CHAT_ROLES or not isinstance(content, str):
            raise RecordError(
                f"messages field {key!r} turn {i} must be {{role: {'|'.join(CHAT_ROLES)}, content: text}}, "
                f"got {turn!r:.80}"
            )
        turns.append({"role": role, "content": content})
    if turns[-1]["role"] == "assistant":  # a whole conversation: its answer is not part of the prompt
        turns.pop()
    users = [t for t in turns if t["role"] == "user"]
    if not users or not users[-1]["content"].strip():
        raise RecordError(
            f"messages field {key!r} holds no user turn with text before its last assistant turn"
        )
    return tuple(turns)


def load_jsonl(
    path: str | Path,
    *,
    question_field: str = "question",
    answer_field: str | None = "answer",
    answer_format: AnswerFormat | str = AnswerFormat.RAW,
    on_bad_record: OnBadRecord | str = OnBadRecord.ERROR,
    id_field: str | None = None,
    entry_point_field: str | None = None,
    messages_field: str | None = None,
) -> LoadResult:
    """Read a JSONL file of question/answer records.

    Args:
        path: the ``.jsonl`` file (UTF-8, one JSON object per line; blank lines are ignored); a name
            ending in ``.gz`` is read through gzip.
        question_field, answer_field: the keys holding the problem text and the gold answer (answer_field
            None: no gold, ``answer == ""``).
        answer_format: ``"raw"`` keeps the answer as written (stripped; a JSON number becomes its
            shortest string, ``27.0`` -> ``"27"``); ``"gsm8k"`` takes the text after the last ``####``
            and removes thousands commas.
        on_bad_record: ``"error"`` raises at the first bad line; ``"skip"`` skips and counts bad lines.
        id_field: key of a record id; when None the id is ``"<file stem>:<line number>"``. Ids must be
            unique within the file.
        entry_point_field: code problems: the answer is the test (answer field) then ``check(<entry
            point>)``, and the question (a prompt of code) keeps its whitespace (see parse_record).
        messages_field: a conversational prompt column, instead of question_field (see prompt_turns).

    Every key of a record lands in ``Example.columns``; a key named like the reward call's own arguments
    (RESERVED_COLUMNS) fails the file whatever on_bad_record says.

    Raises:
        DataError: the file is missing or holds no records; with ``on_bad_record="error"``, a line is not
            JSON, not an object, lacks a field, has an empty question or answer, has a GSM8K answer
            without ``####``, or repeats an id (the message reads ``<file>:<line>: <why>``); with
            ``"skip"``, no valid record remains.
    """
    path = Path(path)
    policy = OnBadRecord(on_bad_record)
    fmt = AnswerFormat(answer_format)
    if not path.is_file():
        raise DataError(f"{path}: file not found" if not path.exists() else f"{path}: not a regular file")

    fields = {
        "question_field": question_field,
        "answer_field": answer_field,
        "answer_format": fmt,
        "id_field": id_field,
        "entry_point_field": entry_point_field,
        "messages_field": messages_field,
    }
    examples, reasons, records = _parse_lines(path, policy, fields)
    if records == 0:
        raise DataError(f"{path}: no records (the file is empty or holds only blank lines)")
    if not examples:
        _check_first_record(path, fields)  # every record skipped: a key that maps no column says so
        raise DataError(f"{path}: no valid records; all {len(reasons)} were skipped, the first: {reasons[0]}")
    return LoadResult(examples=examples, skipped=len(reasons), skip_reasons=tuple(reasons))


def _parse_lines(
    path: Path, policy: OnBadRecord, fields: Mapping[str, object]
) -> tuple[list[Example], list[str], int]:
    """Every non-blank line of `path` through `parse_record(**fields)`: (the examples, one reason per
    skipped line, the number of records). A bad line raises DataError under the "error" policy, and a
    reserved column under any policy; else it is skipped with its reason."""
    examples: list[Example] = []
    reasons: list[str] = []
    seen_ids: set[str] = set()
    records = 0
    with gzip.open(path, "rb") if path.name.endswith(".gz") else path.open("rb") as handle:
        for line_number, raw_line in enumerate(handle, start=1):
            if not raw_line.strip():
                continue
            records += 1
            try:
                record = _decode(raw_line)
                if records == 1 and policy is OnBadRecord.ERROR and isinstance(record, Mapping):
                    _raise_column_problems(path, line_number, record, fields)
                example = parse_record(record, **fields, default_id=f"{path.stem}:{line_number}")
                if example.id in seen_ids:
                    raise RecordError(f"duplicate id {example.id!r}")
            except RecordError as exc:
                message = f"{path}:{line_number}: {exc}"
                if policy is OnBadRecord.ERROR or isinstance(exc, ReservedColumnError):
                    raise DataError(message) from None
                reasons.append(message)
                continue
            seen_ids.add(example.id)
            examples.append(example)
    return examples, reasons, records


def _raise_column_problems(
    path: Path, line_number: int, record: Mapping, fields: Mapping[str, object]
) -> None:
    """The first record's keys stand for the file's columns: a data key that maps none of them (or a
    column that cannot be what the key reads) is a config error naming every such key at once."""
    problems = column_problems(list(record), record, fields, f"{path} (line {line_number})")
    if problems:
        raise DataKeyError("; ".join(problems))


def _check_first_record(path: Path, fields: Mapping[str, object]) -> None:
    with gzip.open(path, "rb") if path.name.endswith(".gz") else path.open("rb") as handle:
        for line_number, raw_line in enumerate(handle, start=1):
            if raw_line.strip():
                try:
                    record = _decode(raw_line)
                except RecordError:
                    return
                if isinstance(record, Mapping):
                    _raise_column_problems(path, line_number, record, fields)
                return


def _decode(raw_line: bytes) -> object:
    try:
        text = raw_line.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise RecordError(f"not valid UTF-8 ({exc.reason} at byte {exc.start})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise RecordError(f"not valid JSON ({exc.msg} at column {exc.colno})") from None


def _field_text(record: Mapping, key: str, role: str) -> str:
    if key not in record:
        raise RecordError(f"missing {role} field {key!r} (keys: {sorted(record)})")
    value = record[key]
    if not is_text(value):
        what = f"text or {CONVERSATION}" if role == "question" else "a string or number"
        raise RecordError(f"{role} field {key!r} must be {what}, got {type(value).__name__}")
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    text = str(value).strip()
    if not text:
        raise RecordError(f"empty {role} field {key!r}")
    return text
