"""eval: held-out evaluation needs held-out data; eval.datasets' extra sets."""

import re

from grpo_run.config.checks.base import check
from grpo_run.config.checks.data import validate_data_fields
from grpo_run.config.schema import GENERATED_SOURCES, Config, DataSource, Mode


def validate_eval(cfg: Config) -> None:
    """Held-out evaluation needs held-out data: a file, or a source that makes its own eval split."""
    d = cfg.data
    has_eval = d.eval_path is not None or d.source in GENERATED_SOURCES
    has_eval = has_eval or (d.source == DataSource.HUB and d.eval_split is not None)
    if cfg.eval.every_steps > 0 or cfg.mode == Mode.EVAL:
        check(
            has_eval,
            "data.eval_path",
            d.eval_path,
            f"evaluation is on (eval.every_steps={cfg.eval.every_steps}, mode={cfg.mode.value}) but "
            f"data.source={d.source.value} has no held-out split: give data.eval_path"
            + (" or data.eval_split" if d.source == DataSource.HUB else "")
            + " or set eval.every_steps=0",
        )
    validate_eval_datasets(cfg)


def validate_eval_datasets(cfg: Config) -> None:
    """eval.datasets: each extra held-out set names its metrics (eval/<name>/...) and needs an eval split."""
    for name, d in cfg.eval.datasets.items():
        key = f"eval.datasets.{name}"
        check(
            re.fullmatch(r"[A-Za-z0-9_.-]+", name) is not None,
            "eval.datasets",
            name,
            "a held-out set's name becomes a metric prefix (eval/<name>/accuracy): letters, digits, _ . - only",
        )
        check(
            d.eval_path is not None
            or d.source in GENERATED_SOURCES
            or (d.source == DataSource.HUB and d.eval_split is not None),
            f"{key}.eval_path",
            d.eval_path,
            f"{key}.source={d.source.value} needs a held-out file"
            + (f" or {key}.eval_split" if d.source == DataSource.HUB else ""),
        )
        validate_data_fields(d, key, train=False)
        if d.source in GENERATED_SOURCES:
            check(d.eval_size is not None, f"{key}.eval_size", d.eval_size, f"{d.source.value} needs a size")
        if d.eval_size is not None:
            check(d.eval_size >= 1, f"{key}.eval_size", d.eval_size, "must be >= 1 (or null)")
        check(
            "{question}" in d.prompt_template,
            f"{key}.prompt_template",
            d.prompt_template,
            "must contain {question}",
        )
