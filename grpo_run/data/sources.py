"""Prompt sources by name: one Enum, one loader table, one entry point (:func:`load_split`).

Sources:

* ``arithmetic``: procedural problems (:mod:`grpo_run.data.arithmetic`); needs ``eval_size`` (both
  splits: train skips every eval problem) and ``train_size`` (train split); extra keyword arguments are the generator's knobs (``num_operands``, ``min_digits``,
  ``max_digits``, ``operations``, ``word_problem_fraction``, ``allow_negative``).
* ``jsonl``: any local JSONL file; extra keyword arguments go to :func:`~grpo_run.data.jsonl.load_jsonl`
  (``question_field``, ``answer_field``, ``answer_format``, ``on_bad_record``, ``id_field``,
  ``entry_point_field``, ``messages_field``). Use it for AIME24/AMC23 too (``question_field="problem"``).
* ``hub``: a Hugging Face dataset through ``datasets`` (:mod:`grpo_run.data.hub`: a hub id, a
  ``save_to_disk`` folder or data files), options ``dataset``, ``config``, ``train_split`` (None: carved
  out of the eval split, see below), ``eval_split``, the field options of ``jsonl`` plus
  ``messages_field``, and the local overrides ``local_dir``/``local_files`` ({"train": name, "eval":
  name}), ``evaluate`` (default True; False: the held-out split is neither required nor read). Local
  JSONL files win over the hub split by split: ``train_path``/``eval_path``, else
  ``local_dir``/``local_files[split]`` when both are set; the others come from ``dataset``. With
  ``train_split=None`` the train split is carved from the eval split's records, wherever they come from,
  unless ``train_path`` gives a file; a one-split dataset without ``eval_split`` is carved too
  (:mod:`grpo_run.data.hub_source`). ``data=gsm8k``, ``math500`` and ``humaneval`` are presets of it.

:func:`load_splits` loads both splits at once (a hub dataset opened once), the way a run does.
* ``reasoning_gym``: procedurally generated tasks (:mod:`grpo_run.data.reasoning_gym`, an optional extra);
  sizes as for arithmetic; options ``tasks`` and ``task_config`` (each task's generator settings).

Files and sizes (every file-backed source):

* ``train_path`` / ``eval_path``: one file per split.
* ``path``: one file that serves both splits. It is *carved*: the records are permuted with
  ``random.Random(seed)``; eval is the first ``eval_size`` of the permutation and train the rest, so the
  two never overlap. ``eval_size`` is then required for both splits. A ``hub`` source with
  ``train_split=None`` carves its eval split the same way.
* ``train_size`` / ``eval_size`` (None = all) cap a split to a seeded subset: the first N records of the
  same permutation. The returned records keep file order. Because the eval subset of a file is the same
  with or without carving, passing the same ``seed`` and ``eval_size`` to the train and eval calls keeps
  train and eval disjoint whenever they come from one file; calling the eval split with
  ``eval_size=None`` returns the whole file, which then overlaps a carved train split.
"""

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum
from pathlib import Path
from typing import Any

from grpo_run.config.schema import DataSource
from grpo_run.data.arithmetic import arithmetic_splits
from grpo_run.data.example import DataError, DataKeyError, Example
from grpo_run.data.hub_source import HubOptions, load_hub, log_skipped
from grpo_run.data.jsonl import OnBadRecord, load_jsonl
from grpo_run.data.reasoning_gym import reasoning_gym_splits


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
    **options: Any,
) -> list[Example]:
    """The examples of one split (``"train"`` or ``"eval"``) of a source. See the module docstring.

    Args:
        source: a :class:`DataSource` or its name.
        split: ``"train"`` or ``"eval"``.
        seed: seeds generation (arithmetic), carving and size capping; the same seed must be given to the
            train and eval calls.
        train_size, eval_size: sizes (arithmetic: required) or caps (files: None = all).
        **options: the files, then source-specific options (generator knobs for arithmetic,
            ``load_jsonl`` options for jsonl). The files (each a str or Path, default None):
            ``path``: one file for both splits, carved by ``seed`` (requires ``eval_size``);
            ``train_path``, ``eval_path``: one file per split.

    Raises:
        DataError: a file or dataset cannot be loaded, or the arguments do not fit the source.
        ValueError: an unknown source/split name or a bad generator knob.
    """
    source = DataSource(source)
    return _LOADERS[source](_request(Split(split), seed, train_size, eval_size, options))


def _request(
    split: Split, seed: int, train_size: int | None, eval_size: int | None, options: dict[str, Any]
) -> _Request:
    # The files travel in `options` (every source's keywords) and are taken out of them here: the loaders
    # receive them apart (_Request), and `options` keeps only the source's own.
    options = dict(options)
    path, train_path, eval_path = (options.pop(name, None) for name in ("path", "train_path", "eval_path"))
    if path is not None and (train_path is not None or eval_path is not None):
        raise DataError(
            "give either path (one file carved into train/eval) or train_path/eval_path, not both"
        )
    for name, size in (("train_size", train_size), ("eval_size", eval_size)):
        if size is not None and size < 0:
            raise DataError(f"{name} must be >= 0, got {size}")
    return _Request(
        split=split,
        seed=seed,
        train_size=train_size,
        eval_size=eval_size,
        path=_as_path(path),
        train_path=_as_path(train_path),
        eval_path=_as_path(eval_path),
        options=options,
    )


def load_splits(
    source: DataSource | str,
    *,
    evaluate: bool = True,
    seed: int = 0,
    train_size: int | None = None,
    eval_size: int | None = None,
    note: Callable[[str], None] | None = None,
    **options: Any,
) -> tuple[list[Example], list[Example]]:
    """(train, held-out) of a source, as two :func:`load_split` calls give them, the hub's dataset opened
    once. evaluate False: the held-out split is neither required nor read ([]). note: receives the one
    line saying that a one-split dataset was carved (hub)."""
    common = {"seed": seed, "train_size": train_size, "eval_size": eval_size, **options}
    if DataSource(source) is not DataSource.HUB:
        train = load_split(source, split=Split.TRAIN, **common)
        return train, load_split(source, split=Split.EVAL, **common) if evaluate else []
    request = _request(Split.TRAIN, seed, train_size, eval_size, {**options, "evaluate": evaluate})
    want = (Split.TRAIN.value, Split.EVAL.value) if evaluate else (Split.TRAIN.value,)
    loaded = _hub_splits(request, want=want, note=note)
    return loaded[Split.TRAIN.value], loaded.get(Split.EVAL.value, [])


def _generated(request: _Request, name: str, splits: Callable[..., tuple[list[Example], list[Example]]]):
    """A generated source's split: `splits(seed, train_size, eval_size, **options)` makes both at once, the
    train split skipping every eval problem, so eval_size is needed for both calls."""
    if request.path or request.train_path or request.eval_path:
        raise DataError(f"the {name} source is generated; it takes no path/train_path/eval_path")
    if request.eval_size is None or (request.split is Split.TRAIN and request.train_size is None):
        raise DataError(
            f"the {name} source needs eval_size, and train_size for the train split (train skips the "
            f"eval problems), got train_size={request.train_size}, eval_size={request.eval_size}"
        )
    train_size = request.train_size if request.split is Split.TRAIN else 0
    try:
        train, evaluation = splits(
            seed=request.seed, train_size=train_size, eval_size=request.eval_size, **request.options
        )
    except DataError:
        raise
    except ValueError as err:  # the sizes ask for more distinct problems than the knobs allow: exit 2
        raise DataKeyError(f"data.source={name}: {err}") from None
    return train if request.split is Split.TRAIN else evaluation


def _load_arithmetic(request: _Request) -> list[Example]:
    return _generated(request, "arithmetic", arithmetic_splits)


def _load_jsonl_source(request: _Request) -> list[Example]:
    def read(file: Path) -> list[Example]:
        result = load_jsonl(file, **request.options)
        log_skipped(file, list(result.skip_reasons))
        return result.examples

    return _from_files(request, read=read, name="jsonl")


_HUB_KEYS = ("dataset", "config", "train_split", "eval_split", "local_dir", "local_files", "evaluate")
_FIELD_KEYS = (
    "question_field",
    "answer_field",
    "answer_format",
    "id_field",
    "entry_point_field",
    "messages_field",
    "on_bad_record",
)


def _load_hub(request: _Request) -> list[Example]:
    return _hub_splits(request, want=(request.split.value,))[request.split.value]


def _hub_splits(
    request: _Request, *, want: tuple[str, ...], note: Callable[[str], None] | None = None
) -> dict[str, list[Example]]:
    unknown = sorted(set(request.options) - set(_HUB_KEYS) - set(_FIELD_KEYS))
    if unknown:
        raise DataError(f"the hub source takes no option(s) {unknown}")
    if request.path is not None:
        raise DataError(
            "the hub source takes train_path/eval_path; to carve one file, give it as eval_path with "
            "train_split=None"
        )
    options = request.options
    hub = HubOptions(
        dataset=options.get("dataset"),
        config=options.get("config"),
        train_split=options.get("train_split", "train"),
        eval_split=options.get("eval_split", "test"),
        local_dir=options.get("local_dir"),
        local_files=dict(options.get("local_files") or {}),
        evaluate=options.get("evaluate", True),
    )
    fields = {k: options[k] for k in _FIELD_KEYS if k in options}
    policy = OnBadRecord(fields.pop("on_bad_record", OnBadRecord.ERROR))

    def pick(examples: list[Example], split: str, carved: bool) -> list[Example]:
        return _select(examples, replace(request, split=Split(split)), carved=carved)

    return load_hub(
        hub,
        fields,
        policy,
        train_path=request.train_path,
        eval_path=request.eval_path,
        want=want,
        pick=pick,
        eval_size=request.eval_size,
        seed=request.seed,
        note=note,
    )


def _load_reasoning_gym(request: _Request) -> list[Example]:
    return _generated(request, "reasoning_gym", reasoning_gym_splits)


_LOADERS: dict[DataSource, Callable[[_Request], list[Example]]] = {
    DataSource.ARITHMETIC: _load_arithmetic,
    DataSource.JSONL: _load_jsonl_source,
    DataSource.HUB: _load_hub,
    DataSource.REASONING_GYM: _load_reasoning_gym,
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


def _as_path(value: str | Path | None) -> Path | None:
    return None if value is None else Path(value)
