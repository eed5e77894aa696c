"""eval: held-out evaluation needs held-out data; eval.datasets' extra sets; eval.reward's entries."""

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence

from grpo_run.config.checks.base import check, fail, refuse
from grpo_run.config.checks.data import validate_data_fields
from grpo_run.config.checks.reward import validate_code_exec, validate_reward_model
from grpo_run.config.schema import GENERATED_SOURCES, Config, DataSource, Mode, RewardFunctionConfig

# eval.reward's words; anything else is a list of reward entries.
AUTO = "auto"
TRAIN = "train"
_ENTRY_KEYS = [f.name for f in dataclasses.fields(RewardFunctionConfig)]
# eval.group_by's per-value metrics, eval/<name>/<value> (`pass@1` needs no entry: no set name holds @).
_BY_VALUE_NAMES = ("num_problems", "tool_call_rate", "calls_per_episode")
_WHAT = "must be auto, train, or a list of reward entries shaped like reward.functions' ([] for none)"


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
    check(
        cfg.eval.group_by is None or bool(cfg.eval.group_by),
        "eval.group_by",
        cfg.eval.group_by,
        "a column name, or null",
    )
    eval_reward_setting(cfg.eval.reward, timeout_s=cfg.reward.timeout_s)


def eval_reward_setting(value: object, *, timeout_s: float) -> str | list[RewardFunctionConfig]:
    """eval.reward as AUTO (null too), TRAIN or its entries, each checked as reward.functions' are
    (a `_target_` is imported when the run is built: grpo_run/evaluation/rewards.py); anything else fails.

    Read where it is used, not stored back: a config built in code holds the same kinds of value."""
    if value is None:
        return AUTO
    if isinstance(value, str):
        word = value.lower()
        check(word in (AUTO, TRAIN), "eval.reward", value, _WHAT)
        return word
    check(isinstance(value, (list, tuple)), "eval.reward", value, _WHAT)
    return [_reward_entry(item, f"eval.reward[{i}]", timeout_s) for i, item in enumerate(value)]


def _reward_entry(item: object, key: str, timeout_s: float) -> RewardFunctionConfig:
    """One entry of an eval.reward list (a mapping from YAML or the command line) as a RewardFunctionConfig."""
    if not isinstance(item, RewardFunctionConfig):
        check(
            isinstance(item, Mapping),
            key,
            item,
            "must be an entry: {name: ...}, {_target_: ...} or {model: ...}",
        )
        assert isinstance(item, Mapping)
        for name in item:
            check(name in _ENTRY_KEYS, f"{key}.{name}", item[name], f"unknown key; known: {_ENTRY_KEYS}")
        item = _typed_entry(dict(item), key)
    fn = item
    if fn._target_ and not fn.name:  # named for its target's last part, as the door names reward.functions'
        fn = dataclasses.replace(fn, name=fn._target_.rpartition(".")[2])
    if fn.model is not None:
        validate_reward_model(fn, key)
    elif fn._target_ is None:
        from grpo_run.rewards.names import RewardName  # light module: names only

        known = [n.value for n in RewardName]
        check(fn.name in known, f"{key}.name", fn.name, f"unknown reward; known: {known} (or a _target_)")
        check(fn.range is None, f"{key}.range", fn.range, "is for a _target_; built-ins know their range")
        if fn.name == "code_exec":
            validate_code_exec(fn.kwargs, f"{key}.kwargs", timeout_s)
    check(
        isinstance(fn.weight, (int, float)) and math.isfinite(fn.weight),
        f"{key}.weight",
        fn.weight,
        "must be finite",
    )
    if fn.range is not None:
        ok = len(fn.range) == 2 and all(math.isfinite(x) for x in fn.range) and fn.range[0] < fn.range[1]
        check(ok, f"{key}.range", list(fn.range), "must be [low, high], finite, low < high")
    return fn


def _typed_entry(item: dict, key: str) -> RewardFunctionConfig:
    """A mapping with known keys as the schema's typed entry (a model's settings typed too)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        node = OmegaConf.merge(OmegaConf.structured(RewardFunctionConfig), item)
        fn = OmegaConf.to_object(node)
    except OmegaConfBaseException as err:
        fail(key, item, f"not a reward entry: {str(err).splitlines()[0]}")
    assert isinstance(fn, RewardFunctionConfig)
    return fn


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
        # eval/rewards/<function>_mean is the run's own set's per-function reward.
        check(name != "rewards", "eval.datasets", name, "`rewards` is taken by eval/rewards/<function>_mean")
        refuse(
            cfg.eval.group_by is not None and name in _BY_VALUE_NAMES,
            "eval.datasets",
            name,
            "eval.group_by",
            cfg.eval.group_by,
            f"`{name}` is taken by the per-value metrics eval/{name}/<value>",
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


def validate_group_by(cfg: Config, eval_examples: Sequence, extra: Mapping[str, Sequence]) -> None:
    """Once the data is loaded: eval.group_by names a column every evaluated held-out example has (data's
    first eval.num_prompts and each eval.datasets set's), or the first example without it is named."""
    column = cfg.eval.group_by
    if column is None:
        return
    for name, examples in [("data", eval_examples), *((f"eval.datasets.{n}", s) for n, s in extra.items())]:
        for x in examples[: cfg.eval.num_prompts]:
            check(
                column in x.columns,
                "eval.group_by",
                column,
                f"held-out example {x.id!r} of {name} has no column {column!r} (its columns: "
                f"{', '.join(sorted(x.columns))})",
            )
