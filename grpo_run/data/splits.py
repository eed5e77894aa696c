"""The run's training and held-out examples, from the data config."""

from dataclasses import asdict

from grpo_run.config.schema import GENERATED_SOURCES, Config, DataConfig, Mode
from grpo_run.data.example import Example
from grpo_run.data.sources import DataSource, load_split, load_splits


def evaluation_on(cfg: Config) -> bool:
    """The run evaluates on held-out data: eval.every_steps > 0, or mode=eval."""
    return cfg.eval.every_steps > 0 or cfg.mode == Mode.EVAL


def load_data(d: DataConfig, *, evaluate: bool = True) -> tuple[list[Example], list[Example]]:
    """(train, held-out); the held-out split is empty when the config has none (`has_eval_split`) or
    evaluation is off (evaluate False: nothing of it is required or read). A one-split hub dataset carved
    for evaluation says so in one console line."""
    return load_splits(
        d.source,
        evaluate=evaluate and has_eval_split(d),
        train_path=d.train_path,
        eval_path=d.eval_path,
        note=_say,
        **_split_options(d),
    )


def _say(line: str) -> None:
    from grpo_run.tracking import console

    console.print(line, soft_wrap=True, markup=False, highlight=False)


def has_eval_split(d: DataConfig) -> bool:
    """A held-out split: a file, a generated one (arithmetic, reasoning_gym), or a dataset's eval split (hub)."""
    if d.eval_path is not None or d.source in GENERATED_SOURCES:
        return True
    return d.source == DataSource.HUB and d.eval_split is not None


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
    elif d.source == DataSource.REASONING_GYM:
        options = {"tasks": list(d.reasoning_gym.tasks), "task_config": dict(d.reasoning_gym.config)}
    elif d.source in (DataSource.JSONL, DataSource.HUB):  # how a record's columns map onto an Example
        options = {
            "question_field": d.question_field,
            "answer_field": d.answer_field,
            "answer_format": d.answer_format,
            "on_bad_record": d.on_bad_record,
            "id_field": d.id_field,
            "entry_point_field": d.entry_point_field,
            "messages_field": d.messages_field,
        }
    if d.source == DataSource.HUB:
        options |= {
            "dataset": d.dataset,
            "config": d.config,
            "train_split": d.train_split,
            "eval_split": d.eval_split,
            "local_dir": d.local_dir,
            "local_files": {"train": d.local_files.train, "eval": d.local_files.eval},
        }
    return {"seed": d.seed, "train_size": d.train_size, "eval_size": d.eval_size, **options}
