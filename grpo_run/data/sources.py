"""Prompt sources by name: one Enum, one loader table, one entry point (:func:`load_split`).

Sources:

* ``arithmetic``: procedural problems (:mod:`grpo_run.data.arithmetic`); needs ``eval_size`` (both
  splits: train skips every eval problem) and ``train_size`` (train split); extra keyword arguments are the generator's knobs (``num_operands``, ``min_digits``,
  ``max_digits``, ``operations``, ``word_problem_fraction``, ``allow_negative``).
* ``jsonl``: any local JSONL file; extra keyword arguments go to :func:`~grpo_run.data.jsonl.load_jsonl`
  (``question_field``, ``answer_field``, ``answer_format``, ``on_bad_record``, ``id_field``). Use it for
  AIME24/AMC23 too (``question_field="problem"``).
* ``gsm8k``: GSM8K question/answer records, gold = the number after ``####`` without commas. Local files
  via ``train_path``/``eval_path``; with no path, ``datasets.load_dataset("openai/gsm8k", "main")``
  (split ``train`` or ``test``), which needs the hub or its local cache.
* ``humaneval``: HumanEval code problems (task_id, prompt, test, entry_point; ``.jsonl`` or ``.jsonl.gz``)
  for the ``code_exec`` reward: the question is the prompt, the answer the test then ``check(<entry
  point>)``, ids from ``task_id``. Only a test split exists: given as ``eval_path`` (or ``path``), the
  train split carved from it like math500's. Any file with the same fields also loads through ``jsonl``
  with ``question_field=prompt answer_field=test entry_point_field=entry_point``.
* ``math500``: MATH-500 problem/answer records, gold LaTeX kept as-is, ids from ``unique_id``. Only a
  test split exists, so the file is given as ``eval_path`` (or ``path``); with no path,
  ``datasets.load_dataset("HuggingFaceH4/MATH-500")`` (split ``test``). Training on it carves the file
  (see below).

Files and sizes (every file-backed source):

* ``train_path`` / ``eval_path``: one file per split.
* ``path``: one file that serves both splits. It is *carved*: the records are permuted with
  ``random.Random(seed)``; eval is the first ``eval_size`` of the permutation and train the rest, so the
  two never overlap. ``eval_size`` is then required for both splits. ``math500``'s train split is always
  carved from its one file (``path``, ``eval_path`` or the hub's test split).
* ``train_size`` / ``eval_size`` (None = all) cap a split to a seeded subset: the first N records of the
  same permutation. The returned records keep file order. Because the eval subset of a file is the same
  with or without carving, passing the same ``seed`` and ``eval_size`` to the train and eval calls keeps
  train and eval disjoint whenever they come from one file; calling the eval split with
  ``eval_size=None`` returns the whole file, which then overlaps a carved train split.
"""

import logging
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from grpo_run.config.schema import DataSource
from grpo_run.data.arithmetic import arithmetic_splits
from grpo_run.data.example import DataError, Example
from grpo_run.data.jsonl import AnswerFormat, RecordError, load_jsonl, parse_record


class Split(StrEnum):
    TRAIN = "train"
    EVAL = "eval"


@dataclass(frozen=True)
class _Request:
    """The arguments of :func:`load_split`, validated, as every loader receives them."""

    split: Split
    seed: int
    train_size: int | None
    eval_size: int | None
    path: Path | None
    train_path: Path | None
    eval_path: Path | None
    options: dict[str, Any]

    @property
    def size(self) -> int | None:
        return self.train_size if self.split is Split.TRAIN else self.eval_size

    @property
    def split_path(self) -> Path | None:
        return self.train_path if self.split is Split.TRAIN else self.eval_path


def load_split(
    source: DataSource | str,
    *,
    split: Split | str,
    seed: int = 0,
    train_size: int | None = None,
    eval_size: int | None = None,
    path: str | Path | None = None,
    train_path: str | Path | None = None,
    eval_path: str | Path | None = None,
    **options: Any,
) -> list[Example]:
    """The examples of one split (``"train"`` or ``"eval"``) of a source. See the module docstring.

    Args:
        source: a :class:`DataSource` or its name.
        split: ``"train"`` or ``"eval"``.
        seed: seeds generation (arithmetic), carving and size capping; the same seed must be given to the
            train and eval calls.
        train_size, eval_size: sizes (arithmetic: required) or caps (files: None = all).
        path: one file for both splits, carved by ``seed`` (requires ``eval_size``).
        train_path, eval_path: one file per split.
        **options: source-specific options (generator knobs for arithmetic, ``load_jsonl`` options for
            jsonl).

    Raises:
        DataError: a file or dataset cannot be loaded, or the arguments do not fit the source.
        ValueError: an unknown source/split name or a bad generator knob.
    """
    source = DataSource(source)
    if path is not None and (train_path is not None or eval_path is not None):
        raise DataError(
            "give either path (one file carved into train/eval) or train_path/eval_path, not both"
        )
    for name, size in (("train_size", train_size), ("eval_size", eval_size)):
        if size is not None and size < 0:
            raise DataError(f"{name} must be >= 0, got {size}")
    request = _Request(
        split=Split(split),
        seed=seed,
        train_size=train_size,
        eval_size=eval_size,
        path=_as_path(path),
        train_path=_as_path(train_path),
        eval_path=_as_path(eval_path),
        options=dict(options),
    )
    return _LOADERS[source](request)


def _load_arithmetic(request: _Request) -> list[Example]:
    if request.path or request.train_path or request.eval_path:
        raise DataError("the arithmetic source is generated; it takes no path/train_path/eval_path")
    if request.eval_size is None or (request.split is Split.TRAIN and request.train_size is None):
        raise DataError(
            "the arithmetic source needs eval_size, and train_size for the train split (train skips the "
            f"eval problems), got train_size={request.train_size}, eval_size={request.eval_size}"
        )
    train_size = request.train_size if request.split is Split.TRAIN else 0
    train, evaluation = arithmetic_splits(
        seed=request.seed, train_size=train_size, eval_size=request.eval_size, **request.options
    )
    return train if request.split is Split.TRAIN else evaluation


def _load_jsonl_source(request: _Request) -> list[Example]:
    def read(file: Path) -> list[Example]:
        result = load_jsonl(file, **request.options)
        if result.skipped:  # data.on_bad_record=skip: say how many, and where the first one was
            logging.getLogger(__name__).warning(
                "%s: skipped %d bad record(s); the first: %s", file, result.skipped, result.skip_reasons[0]
            )
        return result.examples

    return _from_files(request, read=read, name="jsonl")


def _load_gsm8k(request: _Request) -> list[Example]:
    _no_options(request, "gsm8k")

    def read(file: Path) -> list[Example]:
        return load_jsonl(file, answer_format=AnswerFormat.GSM8K).examples

    if request.path is None and request.split_path is None:
        hub_split = "train" if request.split is Split.TRAIN else "test"
        records = _hub_records("openai/gsm8k", "main", hub_split)
        examples = _parse_hub(records, "openai/gsm8k", hub_split, answer_format=AnswerFormat.GSM8K)
        return _select(examples, request, carved=False)
    return _from_files(request, read=read, name="gsm8k")


def _load_math500(request: _Request) -> list[Example]:
    _no_options(request, "math500")
    if request.train_path is not None:
        raise DataError(
            "math500 has only a test split: give its file as eval_path (or path); the train split is "
            "carved from it by seed, leaving eval_size records for eval"
        )
    file = request.path or request.eval_path
    if file is None:
        records = _hub_records("HuggingFaceH4/MATH-500", None, "test")
        examples = _parse_hub(
            records, "HuggingFaceH4/MATH-500", "test", question_field="problem", id_field="unique_id"
        )
    else:
        examples = load_jsonl(file, question_field="problem", id_field="unique_id").examples
    carved = request.split is Split.TRAIN or request.path is not None
    return _select(examples, request, carved=carved)


def _load_humaneval(request: _Request) -> list[Example]:
    _no_options(request, "humaneval")
    if request.train_path is not None:
        raise DataError(
            "humaneval has only a test split: give its file as eval_path (or path); the train split is "
            "carved from it by seed, leaving eval_size records for eval"
        )
    file = request.path or request.eval_path
    if file is None:
        raise DataError("the humaneval source needs eval_path (or path): a local .jsonl(.gz) file")
    fields = {"question_field": "prompt", "answer_field": "test", "entry_point_field": "entry_point"}
    examples = load_jsonl(file, id_field="task_id", **fields).examples
    carved = request.split is Split.TRAIN or request.path is not None
    return _select(examples, request, carved=carved)


_LOADERS: dict[DataSource, Callable[[_Request], list[Example]]] = {
    DataSource.ARITHMETIC: _load_arithmetic,
    DataSource.JSONL: _load_jsonl_source,
    DataSource.GSM8K: _load_gsm8k,
    DataSource.MATH500: _load_math500,
    DataSource.HUMANEVAL: _load_humaneval,
}


def _from_files(request: _Request, *, read: Callable[[Path], list[Example]], name: str) -> list[Example]:
    if request.path is not None:
        return _select(read(request.path), request, carved=True)
    if request.split_path is None:
        kwarg = "train_path" if request.split is Split.TRAIN else "eval_path"
        raise DataError(f"the {name} source needs {kwarg} (or path, one file carved into both splits)")
    return _select(read(request.split_path), request, carved=False)


def _select(examples: Sequence[Example], request: _Request, *, carved: bool) -> list[Example]:
    """The records of the requested split: a seeded permutation, carved and/or capped, in file order."""
    order = list(range(len(examples)))
    random.Random(request.seed).shuffle(order)
    if carved:
        if request.eval_size is None:
            raise DataError("eval_size is required when one file serves both train and eval (it is carved)")
        if request.eval_size >= len(examples) and request.split is Split.TRAIN:
            raise DataError(
                f"eval_size={request.eval_size} leaves no training records out of {len(examples)}"
            )
        held_out, rest = order[: request.eval_size], order[request.eval_size :]
        order = held_out if request.split is Split.EVAL else rest
    if request.size is not None:
        order = order[: request.size]
    return [examples[i] for i in sorted(order)]


def _hub_records(dataset_id: str, config: str | None, split: str) -> list[dict]:
    try:
        import datasets

        return list(datasets.load_dataset(dataset_id, config, split=split))
    except Exception as exc:  # offline, missing cache, hub error: all mean "give a local file"
        raise DataError(
            f"could not load Hugging Face dataset {dataset_id!r} (config {config!r}, split {split!r}): "
            f"{type(exc).__name__}: {exc}. Pass a local JSONL file (train_path/eval_path/path), or "
            "download the dataset once and run with HF_HUB_OFFLINE=1 to use the cache"
        ) from exc


def _parse_hub(
    records: Sequence[dict],
    dataset_id: str,
    split: str,
    *,
    question_field: str = "question",
    answer_format: AnswerFormat = AnswerFormat.RAW,
    id_field: str | None = None,
) -> list[Example]:
    examples = []
    for row, record in enumerate(records):
        try:
            examples.append(
                parse_record(
                    record,
                    question_field=question_field,
                    answer_format=answer_format,
                    id_field=id_field,
                    default_id=f"{dataset_id}:{split}:{row}",
                )
            )
        except RecordError as exc:
            raise DataError(f"{dataset_id} (split {split!r}) row {row}: {exc}") from None
    if not examples:
        raise DataError(f"{dataset_id} (split {split!r}) holds no records")
    return examples


def _no_options(request: _Request, name: str) -> None:
    if request.options:
        raise DataError(f"the {name} source takes no extra options, got {sorted(request.options)}")


def _as_path(value: str | Path | None) -> Path | None:
    return None if value is None else Path(value)
