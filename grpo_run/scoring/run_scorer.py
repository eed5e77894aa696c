"""The run's reward functions bound to their config: what the loop calls to score one round."""

from collections.abc import Collection
from dataclasses import dataclass, field

from grpo_run.config.convert import model_reward_name
from grpo_run.config.schema import Config, RewardConfig, RewardFunctionConfig
from grpo_run.config.validation import ConfigError
from grpo_run.safety.stop import StopRequested
from grpo_run.scoring.dispatch import UserInputs, entry_pool, score
from grpo_run.scoring.pool import RewardPool, RewardPoolError
from grpo_run.scoring.registry import RewardEntry, builtin_entry, weighted_bounds
from grpo_run.scoring.tally import RewardSpec, ScoreResult
from grpo_run.scoring.user import (
    RewardTrainerState,
    UserReward,
    UserRewardError,
    check_callable,
    describe_unfilled,
    import_target,
    unfilled_parameters,
)
from grpo_run.tracking import console


def reward_name(fn: RewardFunctionConfig) -> str:
    """The name metrics use (`train/rewards/<name>_mean`): the built-in's, or the entry's `name`, which the
    config's door sets to the last part of its `_target_`, or a model's kind, when not given."""
    if not fn.name and fn.model is not None:
        return model_reward_name(fn.model.kind)
    return str(fn.name or (fn._target_ or "").rpartition(".")[2])


def entry_of(fn: RewardFunctionConfig, key: str) -> RewardEntry:
    """The registry entry of one `reward.functions[i]` (`key`): a built-in by name, or a user's function
    by `_target_`, imported and its signature checked here, or a reward model or judge by `model`; a
    ConfigError naming the key otherwise."""
    if fn.model is not None:
        from grpo_run.scoring.model_reward import model_entry  # torch and transformers: only when asked

        return model_entry(fn, key)
    if fn._target_ is None:
        try:
            return builtin_entry(str(fn.name))
        except ValueError as err:
            raise ConfigError(f"{key}.name={fn.name!r}: {err} (or set {key}._target_ to your own)") from None
    try:
        check_callable(import_target(fn._target_), fn.kwargs)
    except UserRewardError as err:
        raise ConfigError(f"{key}._target_={fn._target_!r}: {err}") from None
    low_high = None if fn.range is None else (float(fn.range[0]), float(fn.range[1]))
    return RewardEntry(
        UserReward(fn._target_, fn.kwargs),
        range=None if low_high is None else (lambda _kwargs: low_high),
        isolated=fn.isolated,
        columns=True,
    )


def check_columns(cfg: RewardConfig, columns: Collection[str]) -> None:
    """Once the data is loaded, before any model: a user function's named parameter that neither the
    call nor a column of the data fills would fail on every completion of every step, so it is a
    ConfigError naming the entry, the function, the parameter and the columns there are."""
    for i, fn in enumerate(cfg.functions):
        if fn._target_ is None or fn.model is not None:
            continue
        missing = unfilled_parameters(import_target(fn._target_), fn.kwargs, columns)
        if missing:
            raise ConfigError(
                f"reward.functions[{i}]._target_={fn._target_!r}: {describe_unfilled(missing[0], columns)}"
            )


def reward_specs(cfg: RewardConfig) -> list[RewardSpec]:
    """The run's specs, every entry resolved: this is the check that runs before any model loads."""
    specs = []
    for i, fn in enumerate(cfg.functions):
        entry = entry_of(fn, f"reward.functions[{i}]")
        kwargs = {} if fn._target_ else dict(fn.kwargs)  # a user's kwargs travel inside its UserReward
        specs.append(RewardSpec(reward_name(fn), fn.weight, kwargs, entry))
    names = [spec.name for spec in specs]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ConfigError(
            f"reward.functions: the name(s) {twice} appear twice; give each entry its own `name`"
        )
    return specs


@dataclass
class RunScorer:
    cfg: RewardConfig
    pool: RewardPool = field(default_factory=RewardPool)
    report_errors: bool = True  # the main rank prints the first traceback
    # The run's length, for the `trainer_state` a user's reward receives (run_scorer builds it from the
    # config): steps, prompts drawn per step, and the training split's size (an epoch).
    max_steps: int = 0
    prompts_per_step: int = 0
    train_size: int = 0
    _reported: bool = False
    _warned_unscorable: bool = False
    specs: list[RewardSpec] = field(init=False)
    # The pools of the entries that run in a worker of their own (a model), by name: started, and their
    # models loaded, here, before the first step.
    pools: dict[str, RewardPool] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self.specs = reward_specs(self.cfg)
        for spec in self.specs:
            entry = spec.entry
            if entry is not None and entry.own_worker:
                if self.report_errors:
                    console.print(
                        f"reward {spec.name!r}: {entry.fn!r}, loading in a worker process of its own"
                    )
                pool = self.pools[spec.name] = entry_pool(entry)
                try:
                    pool.start(entry.fn, entry.preload, entry.prepare)
                except StopRequested:  # a stop while the model loads: the run ends, nothing failed
                    self.close()
                    raise
                except Exception as err:
                    self.close()
                    if isinstance(err, RuntimeError):  # the model's own ModelLoadError says what to do
                        raise
                    raise RewardPoolError(
                        f"reward {spec.name!r}: the worker of {entry.fn!r} could not start or load it: "
                        f"{type(err).__name__}: {err}"
                    ) from err

    def trainer_state(self, step: int) -> RewardTrainerState:
        """TRL's `trainer_state` while training step `step` (from 1) is scored: step - 1 updates done."""
        done = max(step - 1, 0)
        return RewardTrainerState.of_run(done, self.max_steps, self.prompts_per_step, self.train_size)

    @property
    def wants_columns(self) -> bool:
        """Whether an entry reads the examples' columns (a user's function, reasoning_gym): only then does
        the loop gather them and the completion ids."""
        return any(spec.entry is not None and spec.entry.columns for spec in self.specs)

    @property
    def bounds(self) -> tuple[float, float] | None:
        """The weighted total's (lowest, highest) value; None when a user entry gave no `range`."""
        return weighted_bounds(
            [
                (spec.weight, None if e.range is None else e.range(spec.kwargs))
                for spec in self.specs
                if (e := spec.entry)
            ]
        )

    def __call__(
        self,
        prompts: list[str],
        completions: list[str],
        answers: list[str],
        completion_lengths: list[int],
        user_inputs: UserInputs | None = None,
    ) -> ScoreResult:
        result = score(
            self.specs,
            prompts,
            completions,
            answers,
            timeout_s=self.cfg.timeout_s,
            pool=self.pool,
            batch_kwargs={"completion_lengths": completion_lengths},
            user_inputs=user_inputs,
            pools=self.pools,
        )
        if result.restarts:  # on every rank: the rank whose worker died is the one that knows
            console.print(
                f"[yellow]reward workers died {result.restarts} time(s) (killed by a signal, e.g. the OOM "
                "killer) and were replaced; their completions were scored again (train/reward_worker_restarts)",
                soft_wrap=True,
            )
        if result.unscorable and self.report_errors and not self._warned_unscorable:
            self._warned_unscorable = True  # once a run, as TRL warns; the count is logged every step
            console.print(
                f"[yellow]{result.unscorable} of {len(completions)} completions got no reward: every reward "
                "function returned None for them (or a reward model or the sandbox failed). They are left out "
                "of their group's mean and std with advantage 0 (train/reward_unscorable); a function that "
                "returns None where it does not apply needs another that does",
                soft_wrap=True,
            )
        if result.first_error and self.report_errors and not self._reported:
            self._reported = True  # later ones are only counted
            console.print(
                "[yellow]a reward function failed (counted in train/reward_errors; a rule scores 0 there, a reward "
                f"model or the sandbox leaves the completion unscored):\n{result.first_error}"
            )
        return result

    def close(self) -> None:
        self.pool.close()
        for pool in self.pools.values():
            pool.close()


def run_scorer(cfg: Config, train_size: int, *, report_errors: bool) -> RunScorer:
    """The run's scorer: its reward entries, its pool, and the run's length for `trainer_state`."""
    t = cfg.trainer
    return RunScorer(
        cfg.reward,
        reward_pool(cfg.reward),
        report_errors=report_errors,
        max_steps=t.max_steps,
        prompts_per_step=t.prompts_per_step,
        train_size=train_size,
    )


def reward_pool(cfg: RewardConfig) -> RewardPool:
    """The run's pool: reward.workers processes; a code-only run's workers skip math-verify's import."""
    if all(fn.name == "code_exec" and fn._target_ is None for fn in cfg.functions):
        return RewardPool(max_workers=cfg.workers, preload=("grpo_run.sandbox.reward",))
    return RewardPool(max_workers=cfg.workers)


def log_sandbox(cfg: RewardConfig) -> None:
    """Say in the run's log which isolation the code sandbox gets on this machine (code_exec only)."""
    for fn in cfg.functions:
        if fn.name == "code_exec" and fn._target_ is None:
            from grpo_run.sandbox.reward import describe_isolation

            probe = describe_isolation(str(fn.kwargs.get("isolation", "auto")))
            if probe.outcome.value == "passed":
                console.print(f"code_exec sandbox: {probe.isolation}")
            else:  # every completion will be unscorable: say why at once
                console.print(f"[red]code_exec sandbox does not work here: {probe.detail}")
