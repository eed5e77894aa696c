"""data: where the prompts come from, their record fields, the prompt template and few-shot turns."""

from grpo_run.config.checks.base import check
from grpo_run.config.schema import GENERATED_SOURCES, Config, DataConfig, DataSource

CHAT_ROLES = ("system", "user", "assistant", "tool")


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
