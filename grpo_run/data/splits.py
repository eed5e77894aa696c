"""The run's training and held-out examples, from the data config."""

from dataclasses import asdict

from grpo_run.config.schema import DataConfig
from grpo_run.data.example import Example
from grpo_run.data.sources import DataSource, load_split


def load_data(d: DataConfig) -> tuple[list[Example], list[Example]]:
    """(train, held-out); the held-out split is empty for a file source without `data.eval_path`."""
    common = _split_options(d)
    train = load_split(d.source, split="train", train_path=d.train_path, eval_path=d.eval_path, **common)
    return train, load_eval_split(d)


def has_eval_split(d: DataConfig) -> bool:
    return d.eval_path is not None or d.source in (
        DataSource.ARITHMETIC,
        DataSource.MATH500,
        DataSource.HUMANEVAL,
    )


def load_eval_split(d: DataConfig) -> list[Example]:
    """The held-out examples of one data config alone (empty when it has none); eval.datasets reads only
    this split, so a set needs no training file."""
    if not has_eval_split(d):
        return []
    return load_split(
        d.source, split="eval", train_path=d.train_path, eval_path=d.eval_path, **_split_options(d)
    )


def _split_options(d: DataConfig) -> dict:
    options: dict = {}
    if d.source == DataSource.ARITHMETIC:
        options = asdict(d.arithmetic)
    elif d.source == DataSource.JSONL:
        options = {
            "question_field": d.question_field,
            "answer_field": d.answer_field,
            "answer_format": d.answer_format,
            "on_bad_record": d.on_bad_record,
            "entry_point_field": d.entry_point_field,
        }
    return {"seed": d.seed, "train_size": d.train_size, "eval_size": d.eval_size, **options}
