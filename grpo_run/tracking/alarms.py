"""In-flight alarms: runs that cannot learn, said while they run (docs/plan.md, "Alarms").

`Alarms.observe` takes each step's reduced metrics (already on the host, the same on every rank) and
returns `alerts/*` values for that step: 1.0 while an alarm's condition holds, else 0.0. The first time
an alarm's condition holds it is printed once with its remedy, and raised as a W&B alert when W&B is on.
The streaks and the alarms already said are checkpointed: a resumed run continues them.
"""

import math
from collections.abc import Callable

from grpo_run import metrics as M
from grpo_run.config.schema import AlertsConfig, GenerationConfig, TrainerConfig
from grpo_run.tracking.sinks import Tracker, console

# A fraction computed as count / count is exactly 1.0; the slack only guards float sums.
ONE = 1.0 - 1e-9


class Alarms:
    def __init__(
        self,
        cfg: AlertsConfig,
        *,
        max_new_tokens: int,
        completions_per_round: int,
        max_consecutive_nonfinite: int,
        announce: Callable[[str, str], None] | None,
    ) -> None:
        """completions_per_round: B·G of the whole step (all ranks); announce(title, text): prints and
        raises the alert (None on ranks that write nothing)."""
        self.cfg = cfg
        self.max_new_tokens = max_new_tokens
        self.completions_per_round = completions_per_round
        self.max_consecutive_nonfinite = max_consecutive_nonfinite
        self.announce = announce
        self.truncated_streak = 0
        self.zero_std_streak = 0
        self.nonfinite_streak = 0
        self.empty_streak = 0
        self.fired: set[str] = set()

    def state_dict(self) -> dict:
        """The streaks and the alarms already said: a resumed run continues them (checkpointed)."""
        return {
            "truncated_streak": self.truncated_streak,
            "zero_std_streak": self.zero_std_streak,
            "nonfinite_streak": self.nonfinite_streak,
            "empty_streak": self.empty_streak,
            "fired": sorted(self.fired),
        }

    def load_state_dict(self, state: dict) -> None:
        self.truncated_streak = int(state.get("truncated_streak", 0))
        self.zero_std_streak = int(state.get("zero_std_streak", 0))
        self.nonfinite_streak = int(state.get("nonfinite_streak", 0))
        self.empty_streak = int(state.get("empty_streak", 0))
        self.fired = set(state.get("fired", []))

    def observe(self, step: int, m: dict[str, float]) -> dict[str, float]:
        if not self.cfg.enabled:
            return {}
        active: dict[str, str] = {}  # key -> message, for the conditions that hold at this step
        self._truncation(m, active)
        self._zero_std(m, active)
        self._reward_failures(m, active)
        self._kl(m, active)
        self._nonfinite(m, active)
        self._weights_unchanged(m, active)
        self._empty(m, active)
        for key, text in active.items():
            if key not in self.fired:
                self.fired.add(key)
                if self.announce is not None:
                    self.announce(f"grpo-run {key} (step {step})", text)
        return {key: float(key in active) for key in M.ALERT_KEYS}

    def _truncation(self, m: dict[str, float], active: dict[str, str]) -> None:
        c = self.cfg
        frac = m.get(M.TRUNCATED_FRACTION, 0.0)
        self.truncated_streak = self.truncated_streak + 1 if frac >= c.truncated_fraction else 0
        if self.truncated_streak >= c.truncated_steps:
            active[M.ALERT_TRUNCATED] = (
                f"completions are cut at max_new_tokens={self.max_new_tokens}: {frac:.0%} of this step's hit it "
                f"without EOS, {self.truncated_streak} steps in a row. Raise generation.max_new_tokens, ask for "
                "shorter answers in data.prompt_template, or keep them out of the loss (grpo.mask_truncated=true, "
                "reward=overlong_penalty)"
            )

    def _zero_std(self, m: dict[str, float], active: dict[str, str]) -> None:
        c = self.cfg
        all_equal = m.get(M.FRAC_REWARD_ZERO_STD, 0.0) >= ONE
        self.zero_std_streak = self.zero_std_streak + 1 if all_equal else 0
        if self.zero_std_streak < c.zero_std_steps:
            return
        n = self.zero_std_streak
        if m.get(M.FRAC_ALL_WRONG, 0.0) >= ONE:
            active[M.ALERT_ALL_WRONG] = (
                f"no learning signal: every group's completions all scored the reward's minimum, {n} steps in "
                "a row (advantages 0, loss 0). The task is too hard for the model or the reward never matches "
                "its answers: look at the completions (logger.log_completions_every=1), check the answer "
                "format the reward expects, use easier data, a larger grpo.group_size or a higher temperature"
            )
        elif m.get(M.FRAC_ALL_CORRECT, 0.0) >= ONE:
            active[M.ALERT_ALL_CORRECT] = (
                f"no learning signal: every group's completions all scored the reward's maximum, {n} steps in "
                "a row. The task is too easy for the model: use harder data, or a reward that separates better"
            )
        else:
            active[M.ALERT_NO_SIGNAL] = (
                f"no learning signal: within every group all completions scored the same, {n} steps in a row. "
                "Does the reward depend on the completion at all? Check reward.functions and its kwargs"
            )

    def _reward_failures(self, m: dict[str, float], active: dict[str, str]) -> None:
        failures = m.get(M.REWARD_ERRORS, 0.0) + m.get(M.REWARD_TIMEOUTS, 0.0)
        completions = self.completions_per_round * max(m.get(M.GENERATION_ROUNDS, 1.0), 1.0)
        share = failures / completions
        if share > self.cfg.reward_failure_fraction:
            active[M.ALERT_REWARD_FAILURES] = (
                f"{share:.0%} of this step's completions got no reward: {m.get(M.REWARD_ERRORS, 0.0):g} errors, "
                f"{m.get(M.REWARD_TIMEOUTS, 0.0):g} timeouts (scored 0, or unscored for a reward model or the "
                "sandbox; not learned from as intended). The first "
                "traceback is printed above; for timeouts raise reward.timeout_s"
            )

    def _kl(self, m: dict[str, float], active: dict[str, str]) -> None:
        kl = m.get(M.KL)
        if kl is not None and kl > self.cfg.kl_max:
            active[M.ALERT_KL] = (
                f"train/kl={kl:.3g} per token is above alerts.kl_max={self.cfg.kl_max:g}: the policy moves far "
                "from the reference. Lower trainer.lr, raise grpo.beta, or use kl_control=adaptive"
            )

    def _nonfinite(self, m: dict[str, float], active: dict[str, str]) -> None:
        grad_norm = m.get(M.GRAD_NORM)
        bad = m.get(M.SKIPPED_STEPS, 0.0) > 0 or (grad_norm is not None and not math.isfinite(grad_norm))
        self.nonfinite_streak = self.nonfinite_streak + 1 if bad else 0
        if self.nonfinite_streak >= self.cfg.nonfinite_steps:
            active[M.ALERT_NONFINITE] = (
                f"{self.nonfinite_streak} step(s) in a row skipped their update for a non-finite loss or "
                f"gradient; the run stops after trainer.max_consecutive_nonfinite={self.max_consecutive_nonfinite} "
                "in a row. Lower trainer.lr, check the rewards' scale, or train in float32 (model.dtype=float32)"
            )

    def _weights_unchanged(self, m: dict[str, float], active: dict[str, str]) -> None:
        """An applied update with a non-zero gradient that moved no trainable parameter, not even by one
        unit in the last place: the run trains nothing. Bit-exact 0, not a threshold, so a run whose
        weights moved at all never fires it (a step warming up from a small lr included)."""
        grad_norm, moved = m.get(M.GRAD_NORM), m.get(M.UPDATE_NORM)
        if grad_norm is None or moved is None or m.get(M.SKIPPED_STEPS, 0.0) > 0:
            return
        if math.isfinite(grad_norm) and grad_norm > 0 and moved == 0:
            active[M.ALERT_WEIGHTS_UNCHANGED] = (
                f"the update changed no trainable parameter (train/update_norm=0) although train/grad_norm="
                f"{grad_norm:.3g}: the run trains nothing. Is the learning rate 0 (train/lr), are the optimizer's "
                "parameters the ones the model computes with (a LoRA adapter wrapped or replaced after the "
                "optimizer was built), or is the lr too small to change weights of this precision (bf16 weights "
                "without a float32 master copy)?"
            )

    def _empty(self, m: dict[str, float], active: dict[str, str]) -> None:
        """Replies of (nearly) nothing but the end-of-turn token: the collapse a reward or teacher that
        favours the empty reply drives a run into (distill=self did, docs/performance.md). Not said when
        generation.max_new_tokens itself allows no longer reply."""
        length = m.get(M.COMPLETION_LEN_MEAN)
        if length is None or self.max_new_tokens <= self.cfg.empty_length:
            return
        self.empty_streak = self.empty_streak + 1 if length < self.cfg.empty_length else 0
        if self.empty_streak >= self.cfg.empty_steps:
            active[M.ALERT_EMPTY] = (
                f"completions are (nearly) empty: train/completion_len_mean={length:.2f} tokens, the end-of-turn "
                f"token counted, {self.empty_streak} steps in a row: the policy ends its reply at once. A reward "
                "or teacher that favours the empty reply does this: with distill=self the self-teacher's KL is "
                "0 there (lower distill.coef, mix the task reward in with distill.reward_weight, or use a fixed "
                "teacher), and a length penalty can outweigh the task reward. Look at the completions "
                "(logger.log_completions_every=1)"
            )


def build_alarms(
    cfg: AlertsConfig,
    generation: GenerationConfig,
    trainer: TrainerConfig,
    *,
    group_size: int,
    tracker: Tracker | None,
) -> Alarms:
    """The run's alarms: printed with the console and raised through the tracker's W&B sink (None on the
    ranks that write nothing)."""

    def announce(title: str, text: str) -> None:
        console.print(f"[bold yellow]alert[/] {title}: {text}", soft_wrap=True)
        tracker.alert(title, text)

    return Alarms(
        cfg,
        max_new_tokens=generation.max_new_tokens,
        completions_per_round=trainer.prompts_per_step * group_size,
        max_consecutive_nonfinite=trainer.max_consecutive_nonfinite,
        announce=announce if tracker is not None else None,
    )
