"""reward: the functions (built-in names, a user's _target_, a reward model or judge), their weights and
ranges, the built-ins' and the models' options, and the scoring pool's budget."""

import math
import re
from dataclasses import asdict
from pathlib import Path

from grpo_run.config.checks.base import check, fail, refuse
from grpo_run.config.checks.model import check_model_path
from grpo_run.config.schema import GENERATED_SOURCES, Config, RewardFunctionConfig, RewardModelKind


def validate_rewards(cfg: Config) -> None:
    check(len(cfg.reward.functions) > 0, "reward.functions", [], "needs at least one reward function")
    from grpo_run.rewards.names import RewardName  # light module: names only

    known = [n.value for n in RewardName]
    for i, fn in enumerate(cfg.reward.functions):
        key = f"reward.functions[{i}]"
        if fn.model is not None:
            validate_reward_model(fn, key)
        elif fn._target_ is None:  # a user's _target_ is imported and checked when the run is built
            check(fn.name in known, f"{key}.name", fn.name, f"unknown reward; known: {known} (or a _target_)")
            check(
                not fn.isolated, f"{key}.isolated", fn.isolated, "is for a _target_; built-ins set their own"
            )
            check(fn.range is None, f"{key}.range", fn.range, "is for a _target_; built-ins know their range")
        check(math.isfinite(fn.weight), f"{key}.weight", fn.weight, "must be finite")
        if fn.range is not None:
            ok = len(fn.range) == 2 and all(math.isfinite(x) for x in fn.range) and fn.range[0] < fn.range[1]
            check(ok, f"{key}.range", list(fn.range), "must be [low, high], finite, low < high")
    check(cfg.reward.timeout_s > 0, "reward.timeout_s", cfg.reward.timeout_s, "must be > 0")
    check(cfg.reward.workers >= 1, "reward.workers", cfg.reward.workers, "must be >= 1")
    failed = cfg.reward.max_failed_steps
    check(failed >= 0, "reward.max_failed_steps", failed, "must be >= 0 (0: never stop)")


def validate_gold_answers(cfg: Config, *, answered: bool) -> None:
    """Once the data is loaded (`answered`: some training record has a gold answer): a gold-answer reward
    on records without one (a file or hub source whose data.answer_field is null and whose records hold no
    `answer` column) would score against nothing, silently, so it is refused naming both keys. The
    generated sources (arithmetic, reasoning_gym) always carry their answers."""
    from grpo_run.rewards.names import RewardName

    # math_verifier compares the final answer with the gold one (none: every completion unscorable);
    # code_exec runs a code problem's tests, which its answer column holds (none: no test runs, and any
    # program that runs to its end passes).
    gold_readers = (RewardName.MATH_VERIFIER, RewardName.CODE_EXEC)
    d = cfg.data
    if answered or d.source in GENERATED_SOURCES or d.answer_field is not None:
        return
    for i, fn in enumerate(cfg.reward.functions):
        refuse(
            fn.model is None and fn._target_ is None and fn.name in gold_readers,
            f"reward.functions[{i}].name",
            fn.name,
            "data.answer_field",
            None,
            "it scores each completion against the record's gold answer, and no training record has one "
            "(data.answer_field is null and the data has no `answer` column); set data.answer_field to the "
            "column that holds it (a code problem's tests for code_exec), or score with a reward that needs "
            "no gold answer",
        )


def validate_reward_options(cfg: Config) -> None:
    """The built-in rewards' kwargs that must agree with the rest of the config."""
    for i, fn in enumerate(cfg.reward.functions):
        if fn.name == "overlong_penalty":
            key = f"reward.functions[{i}].kwargs"
            validate_overlong_penalty(fn.kwargs, key, cfg.generation.max_new_tokens)
        if fn.name == "code_exec":
            validate_code_exec(fn.kwargs, f"reward.functions[{i}].kwargs", cfg.reward.timeout_s)


def validate_code_exec(kwargs: dict, key: str, timeout_s: float) -> None:
    """The sandbox's limits (grpo_run/sandbox/runner.py, Limits); its wall budget inside the pool's."""
    from grpo_run.sandbox.limits import Isolation, Limits

    defaults = asdict(Limits())
    known = {"fraction", "isolation", "temp_dir", *defaults}
    for name in kwargs:
        check(
            name in known, f"{key}.{name}", kwargs[name], f"unknown code_exec option; known: {sorted(known)}"
        )
    isolation = kwargs.get("isolation", "auto")
    choices = [m.value for m in Isolation]
    check(isolation in choices, f"{key}.isolation", isolation, f"must be one of {choices}")
    fraction = kwargs.get("fraction", False)
    check(isinstance(fraction, bool), f"{key}.fraction", fraction, "must be true or false")
    wall = kwargs.get("wall_s", defaults["wall_s"])
    ok = isinstance(wall, (int, float)) and 0 < wall < timeout_s
    check(ok, f"{key}.wall_s", wall, f"must be a number in (0, reward.timeout_s={timeout_s})")
    for name in ("cpu_s", "memory_mb", "file_mb", "processes", "open_files"):
        value = kwargs.get(name, defaults[name])
        check(isinstance(value, int) and value >= 1, f"{key}.{name}", value, "must be an int >= 1")


def validate_overlong_penalty(kwargs: dict, key: str, max_new_tokens: int) -> None:
    """Checked here, because a reward that raises at run time only scores 0 and counts an error."""
    limit = kwargs.get("max_new_tokens")
    check(isinstance(limit, int) and limit >= 1, f"{key}.max_new_tokens", limit, "must be an int >= 1")
    if limit != max_new_tokens:
        fail(f"{key}.max_new_tokens", limit, f"must equal generation.max_new_tokens={max_new_tokens}")
    buffer = kwargs.get("buffer_length")
    ok = isinstance(buffer, int) and 0 < buffer <= limit
    check(ok, f"{key}.buffer_length", buffer, f"must be an int in [1, max_new_tokens={limit}]")
    factor = kwargs.get("penalty_factor", 1.0)
    ok = isinstance(factor, (int, float)) and factor >= 0
    check(ok, f"{key}.penalty_factor", factor, "must be a number >= 0")


DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")


def validate_reward_model(fn: RewardFunctionConfig, key: str) -> None:
    """An entry with a `model`: nothing else that names what to call, a loadable path, its options."""
    from grpo_run.rewards.verdict import JUDGE_OPTIONS, TEMPLATE_FIELDS, Verdict, template_fields

    model = fn.model
    assert model is not None
    what = "an entry is a built-in (name), your function (_target_) or a model (model), one of them"
    check(fn._target_ is None, f"{key}._target_", fn._target_, f"cannot be combined with {key}.model: {what}")
    check(not fn.isolated, f"{key}.isolated", fn.isolated, "a model always runs in a worker of its own")
    check(bool(model.path), f"{key}.model.path", model.path, "needs a transformers folder or a hub id")
    check_model_path(f"{key}.model.path", model.path)
    local = Path(model.path).expanduser()
    if local.is_dir():  # a folder, not a hub id
        ok = (local / "config.json").is_file()
        check(ok, f"{key}.model.path", model.path, "is no model folder (no config.json in it)")
    ok = DEVICE.fullmatch(model.device) is not None
    check(ok, f"{key}.model.device", model.device, "must be auto, cpu, cuda or cuda:N")
    check(model.batch_size >= 1, f"{key}.model.batch_size", model.batch_size, "must be >= 1")
    ok = model.threads is None or model.threads >= 1
    check(ok, f"{key}.model.threads", model.threads, "must be null or >= 1")
    if model.kind == RewardModelKind.CLASSIFIER:
        check(not fn.kwargs, f"{key}.kwargs", dict(fn.kwargs), "a classifier takes no kwargs")
        return
    for name in fn.kwargs:
        ok = name in JUDGE_OPTIONS
        check(
            ok, f"{key}.kwargs.{name}", fn.kwargs[name], f"unknown judge option; known: {list(JUDGE_OPTIONS)}"
        )
    options = {**JUDGE_OPTIONS, **fn.kwargs}
    template = options["template"]
    try:
        fields = template_fields(template) if isinstance(template, str) else None
    except ValueError as err:
        fail(f"{key}.kwargs.template", template, f"does not parse as a format string: {err}")
    ok = fields is not None and "completion" in fields and set(fields) <= set(TEMPLATE_FIELDS)
    why = f"must be a string naming {{completion}} and only {[f'{{{f}}}' for f in TEMPLATE_FIELDS]}"
    check(ok, f"{key}.kwargs.template", template, why)
    verdicts = [v.value for v in Verdict]
    check(
        options["verdict"] in verdicts,
        f"{key}.kwargs.verdict",
        options["verdict"],
        f"must be one of {verdicts}",
    )
    check(
        isinstance(options["yes_text"], str) and options["yes_text"] != "",
        f"{key}.kwargs.yes_text",
        options["yes_text"],
        "must be a non-empty string",
    )
    ok = options["no_text"] is None or (
        isinstance(options["no_text"], str) and options["no_text"] not in ("", options["yes_text"])
    )
    check(
        ok,
        f"{key}.kwargs.no_text",
        options["no_text"],
        "must be null or a non-empty string other than yes_text",
    )
    limit = options["max_new_tokens"]
    ok = isinstance(limit, int) and not isinstance(limit, bool) and limit >= 1
    check(ok, f"{key}.kwargs.max_new_tokens", limit, "must be an int >= 1")
