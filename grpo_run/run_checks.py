"""What the run checks between loading the data and loading the model (a hook of `build_context`)."""

from collections.abc import Callable

from transformers import PreTrainedTokenizerBase

from grpo_run.config.schema import Config
from grpo_run.data import DataSource, Example
from grpo_run.data.limits import check_record_count, fit_prompts
from grpo_run.models.loading import model_config
from grpo_run.tracking import console


def data_where(cfg: Config, split: str) -> str:
    d = cfg.data
    path = d.train_path if split == "train" else d.eval_path
    return (
        f"data.{split}_path={path}"
        if d.source == DataSource.JSONL and path
        else f"data.source={d.source.value}"
    )


def fit_data(
    cfg: Config,
    tokenizer: PreTrainedTokenizerBase,
    format_prompts: Callable[[list[str]], list[str]],
    train: list[Example],
    evaluation: list[Example],
) -> tuple[list[Example], list[Example]]:
    """Records whose prompt cannot fit the model are refused or skipped (docs/reliability.md); then a
    step needs `trainer.prompts_per_step` of them."""
    config = model_config(cfg.model)
    max_positions = getattr(config, "max_position_embeddings", None)

    def count_tokens(questions: list[str]) -> list[int]:
        if not questions:
            return []
        # Exactly what the trainer's generate() feeds the model: the chat-formatted prompt, no extras.
        return [len(ids) for ids in tokenizer(format_prompts(questions), add_special_tokens=False).input_ids]

    out = []
    for split, examples, new_tokens in (
        ("train", train, cfg.generation.max_new_tokens),
        ("eval", evaluation, cfg.eval.max_new_tokens),
    ):
        fit = fit_prompts(
            examples,
            count_tokens=count_tokens,
            max_positions=max_positions,
            max_new_tokens=new_tokens,
            max_prompt_tokens=cfg.data.max_prompt_tokens,
            where=data_where(cfg, split),
        )
        if fit.skipped:
            console.print(
                f"data: skipped {fit.skipped} of {len(examples)} {split} records of {data_where(cfg, split)} "
                f"with prompts over data.max_prompt_tokens={cfg.data.max_prompt_tokens} tokens (or the "
                f"model's {max_positions} positions); the first: record {fit.first_skipped}",
                soft_wrap=True,
                markup=False,
            )
        out.append(fit.kept)
    check_record_count(out[0], batch_size=cfg.trainer.prompts_per_step, where=data_where(cfg, "train"))
    return out[0], out[1]
