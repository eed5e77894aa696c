"""Where the hub source's training and held-out records come from, split by split, and its config errors.

Local JSONL files win over the dataset, split by split (``train_path``/``eval_path``, else ``local_dir``
with the preset's ``local_files``). Otherwise the dataset's splits, where:

* ``train_split`` null, or ``train_split == eval_split``, carves: ``eval_size`` records of that split are
  held out by ``seed`` and the rest is trained on;
* a dataset with one split (a data file or a saved ``Dataset``: one split named ``train``) whose
  ``eval_split`` is not there, with evaluation on, is carved the same way, and a note says so;
* with evaluation off, the held-out split is neither required nor read.

A split or mapped column the dataset lacks is a DataKeyError (a config error, exit 2) naming every such
key of the dataset at once, the splits or columns there are and the likely key.
"""

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grpo_run.config.schema import OnBadRecord
from grpo_run.data.example import DataError, DataKeyError, Example
from grpo_run.data.hub import OpenSplit, UnknownSplit, known_splits, open_split, parse_split, split_problems
from grpo_run.data.jsonl import load_jsonl

TRAIN, EVAL = "train", "eval"
# The environment variable data.local_dir defaults to (conf/data/hub.yaml).
LOCAL_DIR_ENV = "GRPO_RUN_DATA"
# The held-out split's likely names, in the order one is suggested.
EVAL_SPLIT_NAMES = ("test", "validation", "valid", "dev", "eval")

# (examples, "train" | "eval", carved) -> the records of that split (sources._select: the seeded rule).
Pick = Callable[[list[Example], str, bool], list[Example]]


@dataclass(frozen=True)
class HubOptions:
    """The ``hub`` source's own options, apart from the record fields."""

    dataset: str | None
    config: str | None
    train_split: str | None
    eval_split: str | None
    local_dir: str | None
    local_files: dict[str, str | None]
    # Evaluation is on: the held-out split is needed (else it is never read).
    evaluate: bool = True

    def local_file(self, split: str) -> Path | None:
        """The preset's file for this split in ``local_dir`` (GRPO_RUN_DATA), when both are set."""
        name = self.local_files.get(split)
        # An empty GRPO_RUN_DATA counts as unset.
        return None if not self.local_dir or name is None else Path(self.local_dir).expanduser() / name

    def local_dir_origin(self) -> str:
        """How the messages name local_dir: from the environment variable, or set as data.local_dir."""
        if self.local_dir == os.environ.get(LOCAL_DIR_ENV):
            return f"{LOCAL_DIR_ENV}={self.local_dir} (data.local_dir's default)"
        return f"data.local_dir={self.local_dir}"

    def hint(self) -> str:
        """How to do without the hub, for the error of a dataset that cannot be loaded."""
        text = (
            "Give a local file with data.eval_path (the training split is carved from it)"
            if self.train_split is None
            else "Give local files with data.train_path/data.eval_path"
        )
        names = [n for n in (self.local_files.get(s) for s in (TRAIN, EVAL)) if n is not None]
        if names:
            text += f", or set {LOCAL_DIR_ENV} to a folder holding {' and '.join(names)}"
        return text


@dataclass(frozen=True)
class SplitSource:
    """Where one split's records come from: a local file, or a split of the dataset; carved: eval_size
    records of it are held out by the seed (the held-out split) and the rest trained on."""

    file: Path | None
    split: str | None
    carved: bool


def load_hub(
    hub: HubOptions,
    fields: dict[str, Any],
    policy: OnBadRecord,
    *,
    train_path: Path | None,
    eval_path: Path | None,
    want: tuple[str, ...],
    pick: Pick,
    eval_size: int | None,
    seed: int,
    note: Callable[[str], None] | None = None,
) -> dict[str, list[Example]]:
    """The wanted splits' records ("train", "eval"): {split: examples}; "eval" is [] when it has none."""
    loader = _HubLoader(hub, fields, policy)
    sources = loader.sources(train_path, eval_path, opens_train=TRAIN in want)
    wanted = {split: sources[split] for split in want if sources[split] is not None}
    loader.check(wanted)
    out = {split: [] for split in want}
    for split, source in wanted.items():
        out[split] = pick(loader.examples(source), split, source.carved)
    automatic = sources[EVAL]
    if note is not None and loader.one_split_carved and automatic is not None:
        records = len(loader.examples(automatic))
        held = min(eval_size or 0, records)
        note(
            f"data: {hub.dataset} has one split, {automatic.split!r}, and no data.eval_split="
            f"{hub.eval_split!r}: {held} of its {records} records are held out by data.seed={seed}, "
            f"{records - held} trained on"
        )
    return out


class _HubLoader:
    """One load of a hub source: the dataset's splits opened at most once each, and every problem with
    the data keys gathered before any record is parsed."""

    def __init__(self, hub: HubOptions, fields: dict[str, Any], policy: OnBadRecord):
        self.hub, self.fields, self.policy = hub, fields, policy
        self._opened: dict[str, OpenSplit] = {}
        self._missing: dict[str, UnknownSplit] = {}
        self._parsed: dict[SplitSource, list[Example]] = {}
        self.one_split_carved = False

    def sources(
        self, train_path: Path | None, eval_path: Path | None, *, opens_train: bool
    ) -> dict[str, SplitSource | None]:
        """Each split's source; opens_train: the training split is wanted (opened before the held-out
        split is looked for, so that a dataset that cannot be loaded is named with it)."""
        hub = self.hub
        eval_file = eval_path or hub.local_file(EVAL)
        if hub.train_split is None:  # carved out of the held-out split's records, wherever they come from
            if eval_file is None and hub.eval_split is None:
                raise DataError(
                    "the hub source has no held-out split: eval_split is None and train_split is None "
                    "too (nothing to carve the training split from)"
                )
            carved = SplitSource(eval_file, None if eval_file else hub.eval_split, carved=True)
            train = carved if train_path is None else SplitSource(train_path, None, carved=False)
            return {TRAIN: train, EVAL: carved}
        train_file = train_path or hub.local_file(TRAIN)
        train = SplitSource(train_file, None if train_file else hub.train_split, carved=False)
        if eval_file is not None:
            return {TRAIN: train, EVAL: SplitSource(eval_file, None, carved=False)}
        if not hub.evaluate or hub.eval_split is None:
            return {TRAIN: train, EVAL: None}
        if train_file is None and (
            hub.eval_split == hub.train_split or self._only_split(opens_train) == hub.train_split
        ):
            self.one_split_carved = hub.eval_split != hub.train_split
            carved = SplitSource(None, hub.train_split, carved=True)
            return {TRAIN: carved, EVAL: carved}
        return {TRAIN: train, EVAL: SplitSource(None, hub.eval_split, carved=False)}

    def _only_split(self, opens_train: bool) -> str | None:
        """The dataset's one split when eval_split is not among its splits and it has exactly one."""
        if opens_train:
            self._open(self.hub.train_split)
        splits = known_splits(self._dataset(self.hub.eval_split))
        if splits is None:
            self._open(self.hub.eval_split)
            missing = self._missing.get(self.hub.eval_split)
            splits = None if missing is None else missing.splits
        elif self.hub.eval_split not in splits:
            self._missing[self.hub.eval_split] = UnknownSplit(self.hub.dataset, self.hub.eval_split, splits)
        if splits is None or self.hub.eval_split in splits or len(splits) != 1:
            return None
        return splits[0]

    def check(self, wanted: dict[str, SplitSource | None]) -> None:
        """One DataKeyError naming every split and column problem of the wanted dataset splits."""
        problems: list[str] = []
        for split, source in wanted.items():
            if source is None or source.split is None:
                continue
            opened = self._open(source.split)
            if opened is None:
                key = "data.train_split" if split == TRAIN and not source.carved else "data.eval_split"
                if self.hub.train_split is not None and source.split == self.hub.train_split:
                    key = "data.train_split"
                problems.append(self._split_problem(key, self._missing[source.split]))
            else:
                check_values = self.policy is OnBadRecord.ERROR
                problems += split_problems(opened, self.fields, check_values=check_values)
        # A key is named once, for the first split it fails in (the other split's columns are alike).
        first: dict[str, int] = {}
        for i, problem in enumerate(problems):
            first.setdefault(_key(problem), i)
        problems = [p for i, p in enumerate(problems) if first[_key(p)] == i]
        if problems:
            raise DataKeyError("; ".join(problems))

    def examples(self, source: SplitSource) -> list[Example]:
        if source not in self._parsed:
            if source.file is not None:
                self._parsed[source] = self._read_file(source.file)
            else:
                assert source.split is not None
                opened = self._open(source.split)
                assert opened is not None  # check() raised otherwise
                self._parsed[source] = self._parse(source.split, opened)
        return self._parsed[source]

    def _dataset(self, split: str) -> str:
        if self.hub.dataset is None:
            raise DataError(
                f"the hub source needs dataset (a hub id or a local path) for split {split!r}, "
                "or local files (train_path/eval_path)"
            )
        return self.hub.dataset

    def _open(self, split: str) -> OpenSplit | None:
        """The split's columns and rows, opened once; None when the dataset has no such split."""
        if split in self._opened:
            return self._opened[split]
        if split in self._missing:
            return None
        try:
            self._opened[split] = open_split(
                self._dataset(split), self.hub.config, split, hint=self.hub.hint()
            )
        except UnknownSplit as exc:
            self._missing[split] = exc
            return None
        return self._opened[split]

    def _split_problem(self, key: str, missing: UnknownSplit) -> str:
        splits = missing.splits
        text = f"{key}={missing.split!r} is not a split of {self.hub.dataset} (splits: {', '.join(splits)})"
        if key == "data.train_split":
            hint = (
                f"data.train_split={splits[0]} (with evaluation on, data.eval_size of its records are held "
                "out by data.seed)"
                if len(splits) == 1
                else "data.train_split=train"
                if "train" in splits
                else "name one of them in data.train_split"
            )
        else:
            likely = next((s for s in EVAL_SPLIT_NAMES if s in splits and s != self.hub.train_split), None)
            hint = (
                f"data.eval_split={likely}"
                if likely
                else "name one of them in data.eval_split, or data.train_split=null (data.eval_size records "
                "of data.eval_split held out, the rest trained on)"
            )
            hint += ", or eval.every_steps=0 (no evaluation: no held-out split)"
        return f"{text}: {hint}"

    def _parse(self, split: str, opened: OpenSplit) -> list[Example]:
        skipped: list[str] = []
        examples = parse_split(
            self._dataset(split),
            split,
            opened,
            fields=self.fields,
            on_bad_record=skipped.append if self.policy is OnBadRecord.SKIP else None,
        )
        log_skipped(self.hub.dataset, skipped)
        return examples

    def _read_file(self, file: Path) -> list[Example]:
        hub = self.hub
        if hub.local_dir and not file.exists() and file.parent == Path(hub.local_dir).expanduser():
            instead = (
                f"unset {LOCAL_DIR_ENV}"
                if hub.local_dir == os.environ.get(LOCAL_DIR_ENV)
                else "set data.local_dir=null"
            )
            raise DataError(
                f"{file}: file not found ({hub.local_dir_origin()} holds the preset's local files; {instead} "
                "to load the dataset instead)"
            )
        result = load_jsonl(file, on_bad_record=self.policy, **self.fields)
        log_skipped(file, list(result.skip_reasons))
        return result.examples


def _key(problem: str) -> str:
    """The data key a problem line names first (`data.question_field`)."""
    return problem.split("=", 1)[0].split(":", 1)[0]


def log_skipped(where: object, reasons: list[str]) -> None:
    if reasons:  # data.on_bad_record=skip: say how many, and where the first one was
        import logging

        logging.getLogger(__name__).warning(
            "%s: skipped %d bad record(s); the first: %s", where, len(reasons), reasons[0]
        )
