"""The held-out evaluation's own reward (`eval.reward`): which entries score a held-out set, and scoring
each problem's greedy completion with them as training scores its completions.

Whether a set has a gold answer to check (pass@1) and whether the run's reward is one of the built-in gold
checks decide `eval.reward=auto`'s entries (docs/evaluation.md).
"""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from grpo_run.config.checks.evaluation import TRAIN, eval_reward_setting
from grpo_run.config.schema import GENERATED_SOURCES, Config, DataConfig, Mode, RewardFunctionConfig
from grpo_run.config.validation import ConfigError
from grpo_run.rewards.names import RewardName
from grpo_run.scoring import RewardPool, RewardSpec, UserInputs, score
from grpo_run.scoring.run_scorer import entry_of, reward_name

# The built-in rewards that check a completion against the record's gold answer; pass@1 is theirs.
GOLD_CHECKERS = frozenset({RewardName.MATH_VERIFIER, RewardName.CODE_EXEC, RewardName.REASONING_GYM})


def has_gold(d: DataConfig) -> bool:
    """Whether the set's records carry a gold answer (a generated source always does; a file or hub
    dataset unless data.answer_field is null)."""
    return d.source in GENERATED_SOURCES or d.answer_field is not None


def _gold_checked(functions: Sequence[RewardFunctionConfig]) -> bool:
    """The run's reward is built-in gold checking: built-ins only, one of them a gold checker (format or
    an overlong penalty beside it only shape the same check)."""
    builtin = all(fn._target_ is None and fn.model is None for fn in functions)
    return builtin and any(fn.name in GOLD_CHECKERS for fn in functions)


def eval_reward_entries(cfg: Config) -> list[RewardFunctionConfig]:
    """The entries that score the held-out set of `cfg` (its data: data.*, or one eval.datasets set's)."""
    setting = eval_reward_setting(cfg.eval.reward, timeout_s=cfg.reward.timeout_s)
    if isinstance(setting, list):
        return setting
    train = list(cfg.reward.functions)
    if setting == TRAIN or not _gold_checked(train) or not has_gold(cfg.data):
        return train
    return []


def own_entries(cfg: Config) -> bool:
    """eval.reward is a list of its own (not the training entries, whose reward-model workers it may share)."""
    return isinstance(eval_reward_setting(cfg.eval.reward, timeout_s=cfg.reward.timeout_s), list)


def eval_reward_specs(cfg: Config) -> list[RewardSpec]:
    """The specs of `eval_reward_entries`, each resolved (a `_target_` imported and its call checked): a
    ConfigError names the entry's key (eval.reward[i], or reward.functions[i] for the training entries)."""
    prefix = "eval.reward" if own_entries(cfg) else "reward.functions"
    specs = []
    for i, fn in enumerate(eval_reward_entries(cfg)):
        kwargs = {} if fn._target_ else dict(fn.kwargs)  # a user's kwargs travel inside its UserReward
        specs.append(RewardSpec(reward_name(fn), fn.weight, kwargs, entry_of(fn, f"{prefix}[{i}]")))
    names = [spec.name for spec in specs]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ConfigError(f"{prefix}: the name(s) {twice} appear twice; give each entry its own `name`")
    return specs


def check_eval_rewards(cfg: Config) -> None:
    """Every held-out set's eval.reward entries resolved, before any model loads (a `_target_` that does
    not import fails here, not at the first evaluation)."""
    if cfg.eval.every_steps > 0 or cfg.mode == Mode.EVAL:
        eval_reward_specs(cfg)


@dataclass
class RewardScores:
    """The greedy completions' rewards under eval.reward, one per problem (None: unscorable)."""

    total: list[float | None]
    per_function: dict[str, list[float | None]] = field(default_factory=dict)
    errors: int = 0  # (function, completion) cells that raised or ran out of time: 0 there, as in training


def join_user_inputs(parts: Sequence[UserInputs]) -> UserInputs:
    """One UserInputs of several generation batches' (in order); a column some batch lacks is None there."""
    names = list(dict.fromkeys(name for part in parts for name in part.columns))
    columns: dict[str, list] = {name: [] for name in names}
    prompts: list = []
    for part in parts:
        n = len(part.prompts)
        prompts += list(part.prompts)
        for name in names:
            columns[name] += list(part.columns.get(name, [None] * n))
    return UserInputs(prompts=prompts, columns=columns, step=parts[0].step if parts else 0)


@dataclass(frozen=True)
class GreedyRows:
    """What scoring the greedy completions needs besides the specs: one row per problem."""

    questions: list[str]
    answers: list[str]
    texts: list[str]
    lengths: list[int]
    user_inputs: UserInputs


def score_greedy(
    specs: Sequence[RewardSpec],
    rows: GreedyRows,
    *,
    timeout_s: float,
    pool: RewardPool,
    pools: Mapping[str, RewardPool],
) -> RewardScores:
    """Every greedy completion scored by `specs` (score() never raises for a reward that fails: an error
    scores 0 and is counted, None leaves the completion unscorable)."""
    result = score(
        specs,
        rows.questions,
        rows.texts,
        rows.answers,
        timeout_s=timeout_s,
        pool=pool,
        batch_kwargs={"completion_lengths": rows.lengths},
        user_inputs=rows.user_inputs,
        pools=pools,
    )
    return RewardScores(list(result.total), dict(result.per_function), result.errors + result.timeouts)
