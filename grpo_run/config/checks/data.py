"""data: where the prompts come from, their record fields, the prompt template and few-shot turns."""

import re
from dataclasses import asdict

from grpo_run.config.checks.arithmetic import KnobError, bucket_knobs, check_knobs
from grpo_run.config.checks.base import check, fail
from grpo_run.config.schema import GENERATED_SOURCES, ArithmeticConfig, Config, DataConfig, DataSource

CHAT_ROLES = ("system", "user", "assistant", "tool")
# A bucket's name becomes part of metric keys (eval/pass@1/<name>) and of example ids.
_BUCKET_NAME = re.compile(r"[A-Za-z0-9_-]+")


def validate_data(cfg: Config) -> None:
    d = cfg.data
    if d.source == DataSource.JSONL:
        check(bool(d.train_path), "data.train_path", d.train_path, "data.source=jsonl needs a file path")
    if d.source in GENERATED_SOURCES:
        why = f"data.source={d.source.value} generates its problems: it needs a size"
        check(d.train_size is not None, "data.train_size", d.train_size, why)
        check(d.eval_size is not None, "data.eval_size", d.eval_size, why)
    validate_data_fields(d, "data", train=True)
    if d.max_prompt_tokens is not None:
        check(
            d.max_prompt_tokens >= 1, "data.max_prompt_tokens", d.max_prompt_tokens, "must be >= 1 (or null)"
        )
    if d.train_size is not None:
        check(d.train_size >= 1, "data.train_size", d.train_size, "must be >= 1")
    if d.eval_size is not None:
        check(d.eval_size >= 1, "data.eval_size", d.eval_size, "must be >= 1 (or null)")
    check(
        "{question}" in d.prompt_template,
        "data.prompt_template",
        d.prompt_template,
        "must contain {question}",
    )
    for i, m in enumerate(d.few_shot):
        check(
            m.role in CHAT_ROLES,
            f"data.few_shot[{i}].role",
            m.role,
            f"must be one of {', '.join(CHAT_ROLES)}",
        )


def validate_data_fields(d: DataConfig, key: str, *, train: bool) -> None:
    """The record fields, and where a hub source's splits come from (train: the training split is read)."""
    validate_arithmetic_mix(d.arithmetic, f"{key}.arithmetic")
    if d.answer_field is None:
        check(
            d.entry_point_field is None,
            f"{key}.entry_point_field",
            d.entry_point_field,
            f"a code problem's tests are its answer column, but {key}.answer_field is null",
        )
    if d.source != DataSource.HUB:
        return
    check(
        d.train_split is not None or d.eval_split is not None or d.eval_path is not None,
        f"{key}.train_split",
        None,
        f"null carves the training split out of {key}.eval_split, which is null too",
    )
    if d.dataset is None:
        train_file = d.train_path is not None or (d.train_split is None and d.eval_path is not None)
        eval_file = d.eval_path is not None or d.eval_split is None
        check(
            (train_file or not train) and eval_file,
            f"{key}.dataset",
            None,
            "data.source=hub needs a hub id or a local path (a save_to_disk folder, .jsonl/.parquet/.csv "
            f"files), or local JSONL files for every split it reads ({key}.train_path/{key}.eval_path)",
        )


def validate_arithmetic_mix(a: ArithmeticConfig, key: str) -> None:
    """`<key>.mix`: unique metric-safe names, positive shares summing to 1, each bucket's knobs valid."""
    names: set[str] = set()
    top = {k: v for k, v in asdict(a).items() if k != "mix"}
    for i, bucket in enumerate(a.mix):
        at = f"{key}.mix[{i}]"
        check(
            _BUCKET_NAME.fullmatch(bucket.name) is not None,
            f"{at}.name",
            bucket.name,
            "must be a non-empty name of letters, digits, _ and - (it becomes part of metric keys)",
        )
        check(bucket.name not in names, f"{at}.name", bucket.name, "another bucket has this name")
        names.add(bucket.name)
        check(bucket.share > 0, f"{at}.share", bucket.share, "must be > 0")
        try:
            check_knobs(**bucket_knobs(asdict(bucket), top))
        except KnobError as e:
            fail(f"{at}.{e.field}", getattr(bucket, e.field), f"{e} (a null knob takes {key}.{e.field})")
    if a.mix:
        total = sum(b.share for b in a.mix)
        check(
            abs(total - 1.0) <= 1e-6, f"{key}.mix", [b.share for b in a.mix], f"shares sum to {total}, not 1"
        )
