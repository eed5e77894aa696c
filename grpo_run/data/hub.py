"""One split of a Hugging Face dataset as Examples, through `datasets` (cached by it as usual).

``data.dataset`` names one of:

* a hub id (``openai/gsm8k``, with ``data.config``): ``datasets.load_dataset(id, config, split=...)``;
* a folder written by ``save_to_disk`` (a ``Dataset``: one split named ``train``; a ``DatasetDict``: its
  splits): ``datasets.load_from_disk``;
* data files, a path or a glob ending in .json/.jsonl/.parquet/.csv (.gz too):
  ``datasets.load_dataset("json"|"parquet"|"csv", data_files=...)``, one split named ``train``;
* any other existing folder (a dataset repository cloned to disk): ``datasets.load_dataset(folder)``.

Every failure is a one-line DataError naming the dataset, its config and the split; offline with nothing
in the cache it says so and how to give local files instead (the caller's ``hint``). A split the dataset
lacks is an UnknownSplit naming those it has; the caller (sources) turns it, and every column a data key
names that a split lacks (`split_problems`), into one config error.
"""

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grpo_run.data.columns import column_problems
from grpo_run.data.example import DataError, Example
from grpo_run.data.jsonl import RecordError, ReservedColumnError, parse_record, reserved_column_error

DATA_FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}
_COMPRESSIONS = (".gz", ".bz2", ".xz", ".zst")
# A folder save_to_disk wrote: a Dataset's state.json, or a DatasetDict's dataset_dict.json.
_SAVED_MARKERS = ("state.json", "dataset_dict.json")


class UnknownSplit(DataError):
    """The dataset has no split of that name; `splits` are the ones it has."""

    def __init__(self, what: str, split: str, splits: list[str]):
        self.split, self.splits = split, splits
        super().__init__(f"could not load {what}: it has no split {split!r} (splits: {', '.join(splits)})")


@dataclass(frozen=True)
class OpenSplit:
    """One split as `datasets` read it: where (for messages), its column names and its rows."""

    where: str
    columns: list[str]
    rows: list[dict]


def open_split(dataset: str, config: str | None, split: str, *, hint: str) -> OpenSplit:
    """One split's columns and rows; UnknownSplit when the dataset has no such split, a one-line
    DataError for any other failure of `datasets`."""
    columns, rows = _open(dataset, config, split, hint)
    return OpenSplit(f"{dataset} split {split!r}", columns, rows)


def split_problems(opened: OpenSplit, fields: dict[str, Any], *, check_values: bool) -> list[str]:
    """What is wrong with the split's columns, one line each (see columns.column_problems); check_values:
    the first row's values too (a bad row under data.on_bad_record=skip is skipped instead)."""
    first = opened.rows[0] if check_values and opened.rows else None
    return column_problems(opened.columns, first, fields, opened.where)


def parse_split(
    dataset: str,
    split: str,
    opened: OpenSplit,
    *,
    fields: dict[str, Any],
    on_bad_record: Callable[[str], None] | None = None,
) -> list[Example]:
    """The records of one opened split, parsed with ``fields`` (parse_record's field options).

    on_bad_record: None raises at the first bad row; else it receives each bad row's message and the row
    is skipped (data.on_bad_record=skip). A reserved column always raises.
    """
    where = opened.where
    problem = reserved_column_error(opened.columns, where)
    if problem is not None:
        raise problem
    examples: list[Example] = []
    seen: set[str] = set()
    for row, record in enumerate(opened.rows):
        try:
            example = parse_record(record, default_id=f"{dataset}:{split}:{row}", **fields)
            if example.id in seen:
                raise RecordError(f"duplicate id {example.id!r}")
        except RecordError as exc:
            message = f"{where} row {row}: {exc}"
            if on_bad_record is None or isinstance(exc, ReservedColumnError):
                raise DataError(message) from None
            on_bad_record(message)
            continue
        seen.add(example.id)
        examples.append(example)
    if not examples:
        raise DataError(f"{where} holds no usable records")
    return examples


def known_splits(dataset: str) -> list[str] | None:
    """The split names of a local dataset, read without loading its rows: a data file's (one, "train"), a
    save_to_disk folder's; None for a hub id or another folder (found when a split is asked for)."""
    import datasets

    local = Path(dataset).expanduser()
    if is_data_files(dataset):
        return ["train"]
    if local.is_dir() and (local / "dataset_dict.json").is_file():
        return list(datasets.load_from_disk(str(local)))
    if local.is_dir() and (local / "state.json").is_file():
        return ["train"]
    return None


def is_data_files(dataset: str) -> bool:
    """A path or glob of data files (``.jsonl``, ``train-*.parquet``, ``data.csv.gz``), not a hub id."""
    return _builder(dataset) is not None


def _builder(dataset: str) -> str | None:
    name = dataset.lower()
    for compression in _COMPRESSIONS:
        name = name.removesuffix(compression)
    return DATA_FILE_BUILDERS.get(Path(name).suffix)


def _open(dataset: str, config: str | None, split: str, hint: str) -> tuple[list[str], list[dict]]:
    """(column names, rows) of one split; any failure of `datasets` becomes one DataError line."""
    import datasets

    what = f"dataset {dataset!r}" + (
        f" (config {config!r}, split {split!r})" if config else f" (split {split!r})"
    )
    local = Path(dataset).expanduser()
    try:
        if local.is_dir() and any((local / m).is_file() for m in _SAVED_MARKERS):
            loaded = datasets.load_from_disk(str(local))
            if isinstance(loaded, datasets.DatasetDict):
                if split not in loaded:
                    raise UnknownSplit(what, split, list(loaded))
                loaded = loaded[split]
            elif split != "train":  # a saved Dataset is one split, named as a data file's is
                raise UnknownSplit(what, split, ["train"])
        elif is_data_files(dataset):
            files = str(local) if local.exists() else dataset
            loaded = datasets.load_dataset(_builder(dataset), data_files=files, split=split)
        else:
            loaded = datasets.load_dataset(str(local) if local.is_dir() else dataset, config, split=split)
    except DataError:
        raise
    except Exception as exc:  # offline, no cache, a typo in the id, a bad file: one line naming it
        unknown = re.match(r'Unknown split "[^"]*"\. Should be one of \[(.*)\]', str(exc))
        if isinstance(exc, ValueError) and unknown:
            raise UnknownSplit(what, split, [s.strip(" '\"") for s in unknown.group(1).split(",")]) from None
        remote = not local.exists() and not is_data_files(dataset)
        raise DataError(_explain(what, exc, hint, remote=remote)) from None
    return list(loaded.column_names), loaded.to_list()


def _explain(what: str, exc: Exception, hint: str, *, remote: bool) -> str:
    import datasets

    cause = " ".join(f"{type(exc).__name__}: {exc}".split())  # one line, whatever the library wrote
    if remote and (datasets.config.HF_HUB_OFFLINE or "OfflineModeIsEnabled" in cause):
        return f"could not load {what}: offline and not in the datasets cache ({cause}). {hint}"
    return f"could not load {what}: {cause}. {hint}"
