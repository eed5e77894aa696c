"""The run's reward functions bound to their config: what the loop calls to score one round."""

from dataclasses import dataclass, field

from grpo_run.config.schema import RewardConfig
from grpo_run.scoring.pool import RewardPool, RewardSpec, ScoreResult, score
from grpo_run.scoring.registry import reward_bounds
from grpo_run.tracking import console


@dataclass
class RunScorer:
    cfg: RewardConfig
    pool: RewardPool = field(default_factory=RewardPool)
    report_errors: bool = True  # the main rank prints the first traceback
    _reported: bool = False

    @property
    def bounds(self) -> tuple[float, float]:
        """The weighted total's (lowest, highest) value."""
        return reward_bounds([(fn.name, fn.weight, fn.kwargs) for fn in self.cfg.functions])

    def __call__(self, prompts, completions, answers, completion_lengths) -> ScoreResult:
        specs = [RewardSpec(fn.name, fn.weight, dict(fn.kwargs)) for fn in self.cfg.functions]
        result = score(
            specs,
            prompts,
            completions,
            answers,
            timeout_s=self.cfg.timeout_s,
            pool=self.pool,
            batch_kwargs={"completion_lengths": completion_lengths},
        )
        if result.restarts:  # on every rank: the rank whose worker died is the one that knows
            console.print(
                f"[yellow]reward workers died {result.restarts} time(s) (killed by a signal, e.g. the OOM "
                "killer) and were replaced; their completions were scored again (train/reward_worker_restarts)",
                soft_wrap=True,
            )
        if result.first_error and self.report_errors and not self._reported:
            self._reported = True  # later ones are only counted
            console.print(
                f"[yellow]a reward function raised (scored 0, counted in train/reward_errors):\n{result.first_error}"
            )
        return result

    def close(self) -> None:
        self.pool.close()


def reward_pool(cfg: RewardConfig) -> RewardPool:
    """The run's pool: reward.workers processes; a code-only run's workers skip math-verify's import."""
    if all(fn.name == "code_exec" for fn in cfg.functions):
        return RewardPool(max_workers=cfg.workers, preload=("grpo_run.sandbox.reward",))
    return RewardPool(max_workers=cfg.workers)


def log_sandbox(cfg: RewardConfig) -> None:
    """Say in the run's log which isolation the code sandbox gets on this machine (code_exec only)."""
    for fn in cfg.functions:
        if fn.name == "code_exec":
            from grpo_run.sandbox.reward import describe_isolation

            probe = describe_isolation(str(fn.kwargs.get("isolation", "auto")))
            if probe.outcome.value == "passed":
                console.print(f"code_exec sandbox: {probe.isolation}")
            else:  # every completion will be unscorable: say why at once
                console.print(f"[red]code_exec sandbox does not work here: {probe.detail}")
