"""One split of a Hugging Face dataset as Examples, through `datasets` (cached by it as usual).

``data.dataset`` names one of:

* a hub id (``openai/gsm8k``, with ``data.config``): ``datasets.load_dataset(id, config, split=...)``;
* a folder written by ``save_to_disk`` (a ``Dataset``: one split named ``train``; a ``DatasetDict``: its
  splits): ``datasets.load_from_disk``;
* data files, a path or a glob ending in .json/.jsonl/.parquet/.csv (.gz too):
  ``datasets.load_dataset("json"|"parquet"|"csv", data_files=...)``, one split named ``train``;
* any other existing folder (a dataset repository cloned to disk): ``datasets.load_dataset(folder)``.

Every failure is a one-line DataError naming the dataset, its config and the split; offline with nothing
in the cache it says so and how to give local files instead (the caller's ``hint``).
"""

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from grpo_run.data.example import DataError, Example
from grpo_run.data.jsonl import RecordError, ReservedColumnError, parse_record, reserved_column_error

DATA_FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}
_COMPRESSIONS = (".gz", ".bz2", ".xz", ".zst")
# A folder save_to_disk wrote: a Dataset's state.json, or a DatasetDict's dataset_dict.json.
_SAVED_MARKERS = ("state.json", "dataset_dict.json")


def load_hub_split(
    dataset: str,
    config: str | None,
    split: str,
    *,
    fields: dict[str, Any],
    hint: str,
    on_bad_record: Callable[[str], None] | None = None,
) -> list[Example]:
    """The records of one split, parsed with ``fields`` (parse_record's field options).

    on_bad_record: None raises at the first bad row; else it receives each bad row's message and the row
    is skipped (data.on_bad_record=skip). A missing or reserved column always raises, naming the columns
    the split has.
    """
    where = f"{dataset} split {split!r}"
    columns, rows = _open(dataset, config, split, hint)
    problem = reserved_column_error(columns, where)
    if problem is not None:
        raise problem
    for key, name in _wanted_columns(fields):
        if name not in columns:
            raise DataError(f"data.{key}={name!r} not in {where} (columns: {', '.join(columns)})")
    examples: list[Example] = []
    seen: set[str] = set()
    for row, record in enumerate(rows):
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


def is_data_files(dataset: str) -> bool:
    """A path or glob of data files (``.jsonl``, ``train-*.parquet``, ``data.csv.gz``), not a hub id."""
    return _builder(dataset) is not None


def _builder(dataset: str) -> str | None:
    name = dataset.lower()
    for compression in _COMPRESSIONS:
        name = name.removesuffix(compression)
    return DATA_FILE_BUILDERS.get(Path(name).suffix)


def _wanted_columns(fields: dict[str, Any]) -> list[tuple[str, str]]:
    keys = ["answer_field", "id_field", "entry_point_field"]
    keys.insert(0, "messages_field" if fields.get("messages_field") else "question_field")
    return [(key, fields[key]) for key in keys if fields.get(key) is not None]


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
                    raise DataError(_unknown_split(what, split, list(loaded)))
                loaded = loaded[split]
            elif split != "train":  # a saved Dataset is one split, named as a data file's is
                raise DataError(_unknown_split(what, split, ["train"]))
        elif is_data_files(dataset):
            files = str(local) if local.exists() else dataset
            loaded = datasets.load_dataset(_builder(dataset), data_files=files, split=split)
        else:
            loaded = datasets.load_dataset(str(local) if local.is_dir() else dataset, config, split=split)
    except DataError:
        raise
    except Exception as exc:  # offline, no cache, a typo in the id, a bad file: one line naming it
        remote = not local.exists() and not is_data_files(dataset)
        raise DataError(_explain(what, split, exc, hint, remote=remote)) from None
    return list(loaded.column_names), loaded.to_list()


def _unknown_split(what: str, split: str, splits: list[str]) -> str:
    return (
        f"could not load {what}: it has no split {split!r} (splits: {', '.join(splits)}). Name one with "
        "data.train_split/data.eval_split; data.eval_split=null: no held-out split; "
        "data.train_split=null: train on what data.eval_size leaves of data.eval_split"
    )


def _explain(what: str, split: str, exc: Exception, hint: str, *, remote: bool) -> str:
    import datasets

    cause = " ".join(f"{type(exc).__name__}: {exc}".split())  # one line, whatever the library wrote
    unknown = re.match(r'Unknown split "[^"]*"\. Should be one of \[(.*)\]', str(exc))
    if isinstance(exc, ValueError) and unknown:
        return _unknown_split(what, split, [s.strip(" '\"") for s in unknown.group(1).split(",")])
    if remote and (datasets.config.HF_HUB_OFFLINE or "OfflineModeIsEnabled" in cause):
        return f"could not load {what}: offline and not in the datasets cache ({cause}). {hint}"
    return f"could not load {what}: {cause}. {hint}"
