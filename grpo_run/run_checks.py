"""What the run checks between loading the data and loading the model (a hook of `build_context`, and of
`mode=eval` before its model loads): prompts that fit the model, and enough records for a step."""

from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from grpo_run.config.schema import Config, DataConfig, ModelConfig
from grpo_run.data import DataSource, Example
from grpo_run.data.limits import check_record_count, fit_prompts
from grpo_run.data.prompts import chat_prompts
from grpo_run.models.loading import model_config
from grpo_run.tracking import console


def data_where(data: DataConfig, split: str, key: str = "data") -> str:
    """How the messages name a split's records: its file (`data.eval_path=...`), its dataset or its
    source."""
    path = data.train_path if split == "train" else data.eval_path
    if data.source in (DataSource.JSONL, DataSource.HUB) and path:
        return f"{key}.{split}_path={path}"
    if data.source == DataSource.HUB and data.dataset:
        return f"{key}.dataset={data.dataset}"
    return f"{key}.source={data.source.value}"


@dataclass(frozen=True)
class Split:
    """One set of records to check, with the keys its messages name."""

    examples: list[Example]
    data: DataConfig  # how its prompts are formatted, and its max_prompt_tokens
    split: str  # "train" or "eval"
    key: str  # "data" or "eval.datasets.<name>"
    new_tokens: int
    new_tokens_key: str


def fit_data(
    cfg: Config,
    tokenizer: PreTrainedTokenizerBase,
    train: list[Example] | None,
    evaluation: list[Example],
    extra: dict[str, list[Example]],
    model: ModelConfig | None = None,
) -> tuple[list[Example], list[Example], dict[str, list[Example]]]:
    """Records whose prompt cannot fit the model are refused or skipped (docs/reliability.md): the
    training split (None in mode=eval, which has none), data's held-out split and every `eval.datasets`
    set; then a step needs `trainer.prompts_per_step` training records. `model`: the model evaluated
    (mode=eval's checkpoint), else `cfg.model`."""
    config = model_config(model or cfg.model)
    max_positions = getattr(config, "max_position_embeddings", None)
    e = cfg.eval
    splits = {
        "eval": Split(evaluation, cfg.data, "eval", "data", e.max_new_tokens, "eval.max_new_tokens"),
        **{
            name: Split(
                extra[name], d, "eval", f"eval.datasets.{name}", e.max_new_tokens, "eval.max_new_tokens"
            )
            for name, d in e.datasets.items()
        },
    }
    if train is not None:
        g = cfg.generation
        splits = {
            "train": Split(train, cfg.data, "train", "data", g.max_new_tokens, "generation.max_new_tokens"),
            **splits,
        }
    kept = {name: _fit(s, tokenizer, max_positions) for name, s in splits.items()}
    if train is not None:
        check_record_count(
            kept["train"], batch_size=cfg.trainer.prompts_per_step, where=data_where(cfg.data, "train")
        )
    return kept.get("train", []), kept["eval"], {name: kept[name] for name in e.datasets}


def _fit(s: Split, tokenizer: PreTrainedTokenizerBase, max_positions: int | None) -> list[Example]:
    def count_tokens(examples: list[Example]) -> list[int]:
        if not examples:
            return []
        # Exactly what generate() feeds the model: the set's chat-formatted prompt, no extras.
        prompts = chat_prompts(tokenizer, s.data, examples)
        return [len(ids) for ids in tokenizer(prompts, add_special_tokens=False).input_ids]

    where = data_where(s.data, s.split, s.key)
    prompt_key = f"{s.key}.max_prompt_tokens"
    fit = fit_prompts(
        s.examples,
        count_tokens=count_tokens,
        max_positions=max_positions,
        max_new_tokens=s.new_tokens,
        max_prompt_tokens=s.data.max_prompt_tokens,
        where=where,
        prompt_key=prompt_key,
        new_tokens_key=s.new_tokens_key,
    )
    if fit.skipped:
        console.print(
            f"data: skipped {fit.skipped} of {len(s.examples)} {s.split} records of {where} with prompts over "
            f"{prompt_key}={s.data.max_prompt_tokens} tokens (or the model's {max_positions} positions); "
            f"the first: record {fit.first_skipped}",
            soft_wrap=True,
            markup=False,
        )
    return fit.kept
