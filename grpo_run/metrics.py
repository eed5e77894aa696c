"""Every metric key, declared once, and the per-step accumulator.

Values accumulate as tensors on the training device; `StepMetrics.reduce` performs one
all-reduce per reduction kind (sum, max) and a single host copy for the whole step.
"""

import torch

from grpo_run.engine.base import Engine

# train/: the algorithm's health, reduced over every completion of the step.
REWARD_MEAN = "train/reward_mean"
REWARD_STD = "train/reward_std"
REWARD_FN_MEAN = "train/rewards/{}_mean"  # one per reward function
REWARD_FN_ERRORS = "train/rewards/{}_errors"  # one per reward function: its share of train/reward_errors
FRAC_REWARD_ZERO_STD = "train/frac_reward_zero_std"
FRAC_ALL_CORRECT = "train/frac_all_correct"
FRAC_ALL_WRONG = "train/frac_all_wrong"
KL = "train/kl"
CLIP_FRACTION = "train/clip_fraction"
CLIP_FRACTION_LOW = "train/clip_fraction_low"
CLIP_FRACTION_HIGH = "train/clip_fraction_high"
ENTROPY = "train/entropy"
LOSS = "train/loss"
GRAD_NORM = "train/grad_norm"
LR = "train/lr"
BETA = "train/beta"
COMPLETION_LEN_MEAN = "train/completion_len_mean"
COMPLETION_LEN_MAX = "train/completion_len_max"
TRUNCATED_FRACTION = "train/truncated_fraction"
REWARD_ERRORS = "train/reward_errors"
REWARD_TIMEOUTS = "train/reward_timeouts"
REWARD_UNSCORABLE = "train/reward_unscorable"
# Share of the step's scored completions that no reward function scored (each raised, timed out or said
# None): reward.max_failed_steps steps in a row at 1.0 end the run (a broken reward is not a run).
REWARD_FAILED_FRACTION = "train/reward_failed_fraction"
# Reward workers found dead (killed by a signal: the OOM killer) and replaced this step; their completions
# were scored again. Logged only on a step where it is above 0 (see ONLY_WHEN_NONZERO).
REWARD_WORKER_RESTARTS = "train/reward_worker_restarts"
# Completions per outcome kind of a labelling reward function (ScoreResult.labels), summed over the step.
REWARD_FN_OUTCOME = "train/rewards/{}"  # filled with "<function>/<kind>"
CODE_EXEC_OUTCOMES = [
    REWARD_FN_OUTCOME.format(f"code_exec/{kind}")
    for kind in (
        "passed",
        "failed",
        "error",
        "timeout",
        "limit_memory",
        "limit_processes",
        "limit_file_size",
        "limit_open_files",
        "sandbox_failure",
    )
]
# Optimizer updates of the step skipped for a non-finite loss or gradient (logged on steps with an update).
SKIPPED_STEPS = "train/skipped_steps"
DROPPED_GROUPS = "train/dropped_groups"  # zero-std groups left out of the update (grpo.filter_zero_std)
GENERATION_ROUNDS = "train/generation_rounds"  # rounds of B prompts sampled to fill the step
MASKED_TRUNCATED = "train/masked_truncated"  # truncated completions out of the loss (grpo.mask_truncated)
# Where every scored completion went (docs/reliability.md, "Every scored completion is trained or counted
# as dropped"):
# SCORED_COMPLETIONS = TRAINED_COMPLETIONS + the sum of DROPPED_KEYS at every step, or the run stops
# (grpo_run/safety/accounting.py). Counts of completions, summed over rounds and ranks.
SCORED_COMPLETIONS = "train/scored_completions"  # rewards computed this step (every round, every rank)
TRAINED_COMPLETIONS = "train/trained_completions"  # in the update with at least one loss token
DROPPED_ZERO_STD = "train/dropped/zero_std"  # grpo.filter_zero_std: G x train/dropped_groups
DROPPED_SURPLUS = "train/dropped/surplus"  # informative groups past the B a round needed
DROPPED_RANK_BALANCE = "train/dropped/rank_balance"  # kept groups cut so that every rank trains as many
DROPPED_MASKED = "train/dropped/masked"  # no token left in the loss (grpo.mask_truncated's truncated ones)
DROPPED_STALE = "train/dropped/stale"  # rollout=async: batches older than rollout.max_staleness
DROPPED_KEYS = [DROPPED_ZERO_STD, DROPPED_SURPLUS, DROPPED_RANK_BALANCE, DROPPED_MASKED, DROPPED_STALE]
# sqrt of the sum over the step's optimizer updates of |theta_after - theta_before|^2 over the trainable
# parameters (grpo_run/safety/update_norm.py): exactly 0 when no trainable parameter moved.
UPDATE_NORM = "train/update_norm"
# generation=vllm: the sampler's log-probs against the trainer's pi_old (grpo_run/algo/rollout_correction.py).
SAMPLER_LOGPROB_DIFF_MEAN = "train/sampler_logprob_diff_mean"  # mean |log pi_old - log pi_sampler| per token
SAMPLER_LOGPROB_DIFF_MAX = "train/sampler_logprob_diff_max"
SAMPLER_RATIO_MEAN = "train/sampler_ratio_mean"  # rho_s = pi_old / pi_sampler at the correction's level
SAMPLER_RATIO_MAX = "train/sampler_ratio_max"
SAMPLER_MASKED_FRACTION = "train/sampler_masked_fraction"  # loss tokens a mask mode set to weight 0
# The loss variants (docs/algorithm.md), each logged only while its knob is on.
ENTROPY_KEPT_FRACTION = "train/entropy_kept_fraction"  # loss tokens in the top-rho entropy quantile
OFF_POLICY_MASKED_FRACTION = "train/off_policy_masked_fraction"  # loss tokens the off-policy mask drops
TRUST_REGION_MASKED_FRACTION = "train/trust_region_masked_fraction"  # dppo_*: loss tokens outside the region
ENTROPY_COEF = "train/entropy_coef"  # grpo.entropy_control=adaptive: the coefficient this step's loss used
# env/: multi-turn episodes (env != single_turn only, docs/environments.md), over every episode sampled.
ENV_TURNS_MEAN = "env/turns_mean"  # model turns per episode
ENV_TOOL_CALLS_MEAN = "env/tool_calls_mean"  # tool calls per episode
ENV_TOOL_ERRORS = "env/tool_errors"  # calls that failed (bad input, an exception), summed over the step
ENV_TOOL_TIMEOUTS = "env/tool_timeouts"  # calls cut by env.tool_timeout_s
ENV_EPISODES_CUT_BY_TURNS = "env/episodes_cut_by_turns"  # the environment wanted a turn past env.max_turns
ENV_OBSERVATION_TOKENS_MEAN = "env/observation_tokens_mean"  # observation tokens per episode (trainable 0)
# env.call_cost > 0 only: the reward the cost took off, per scorable episode (before advantages).
ENV_CALL_COST_MEAN = "env/call_cost_mean"
# env.tool_free_share > 0 only: the mean reward of the tool-free episodes and of those with the tool, over
# the step's kept groups (as train/reward_mean).
TOOL_FREE_REWARD_MEAN = "train/tool_free_reward_mean"
TOOL_REWARD_MEAN = "train/tool_reward_mean"
# eval.group_by (a difficulty bucket <v> of the training examples), over every completion sampled: kept
# only on a step that sampled the bucket (StepMetrics.reduce drops a bucket mean with nothing counted).
TRAIN_REWARD_MEAN_BY = "train/reward_mean/{}"  # the bucket's scorable completions' mean reward
TRAIN_TOOL_CALL_RATE_BY = "train/tool_call_rate/{}"  # env != single_turn: episodes with >= 1 tool call
BY_VALUE_PREFIXES = (TRAIN_REWARD_MEAN_BY.format(""), TRAIN_TOOL_CALL_RATE_BY.format(""))
ENV_KEYS = [
    ENV_TURNS_MEAN,
    ENV_TOOL_CALLS_MEAN,
    ENV_TOOL_ERRORS,
    ENV_TOOL_TIMEOUTS,
    ENV_EPISODES_CUT_BY_TURNS,
    ENV_OBSERVATION_TOKENS_MEAN,
]
# distill/: on-policy distillation (distill != none only, docs/algorithm.md).
# KL(pi_student || pi_teacher) estimated from the sampled tokens: the mean over loss tokens of k3 =
# exp(d) - d - 1, d = log pi_teacher - log pi_student (>= 0), and of k1 = -d (either sign).
DISTILL_TEACHER_KL = "distill/teacher_kl"
DISTILL_TEACHER_LOGRATIO = "distill/teacher_logratio"
# distill.form=distribution: the mean over loss tokens of the exact divergence of the full distributions.
DISTILL_DIVERGENCE = "distill/divergence"
DISTILL_TEACHER_S = "distill/teacher_s"  # seconds the teacher's scoring pass took this step
# perf/: where the time and memory go.
STEP_S = "perf/step_s"
GENERATE_S = "perf/generate_s"
REFERENCE_S = "perf/reference_s"
TRAIN_S = "perf/train_s"
TOKENS_PER_S = "perf/tokens_per_s"
PEAK_MEM_GB = "perf/peak_mem_gb"
WEIGHT_SYNC_S = "perf/weight_sync_s"  # generation=vllm: pushing the policy's weights into the engine
# async/: rollout=async only (docs/rollouts.md); perf/weight_sync_s is the trainer's share of the weight sync.
ASYNC_STALENESS_MEAN = "async/staleness_mean"  # steps between the sampling weights and the trained ones
ASYNC_STALENESS_MAX = "async/staleness_max"
ASYNC_DROPPED_STALE = "async/dropped_stale"  # batches older than rollout.max_staleness, dropped untrained
ASYNC_TRAINER_WAIT_S = "async/trainer_wait_s"  # the trainer idle, waiting for the step's groups
ASYNC_GENERATOR_WAIT_S = "async/generator_wait_s"  # the worker idle: waiting for weights or queue room
ASYNC_GENERATE_S = "async/generate_s"  # the worker's generation and scoring of the trained batch
# eval/: the held-out set (grpo_run/evaluation/held_out.py), at step 0 and every eval.every_steps steps.
EVAL_ACCURACY = "eval/accuracy"  # greedy pass@1
EVAL_MEAN_AT_K = "eval/mean_at_k"  # mean correctness of k sampled completions per prompt
EVAL_BOXED_FRACTION = "eval/boxed_fraction"  # greedy answers holding a non-empty \boxed{}
EVAL_COMPLETION_LEN = "eval/completion_len_mean"  # greedy completion length, tokens
EVAL_PASS_AT_K = "eval/pass_at_k"  # unbiased pass@k from the same k samples (Chen et al. 2021)
EVAL_NUM_PROBLEMS = "eval/num_problems"  # held-out problems whose gold parses (the n of every interval)
EVAL_TOOL_CALL_RATE = "eval/tool_call_rate"  # env != single_turn: greedy episodes that called a tool
# eval.reward (grpo_run/evaluation/rewards.py): each problem's greedy completion scored by the run's own
# reward entries; means over the scorable ones, with a percentile bootstrap interval over problems.
EVAL_REWARD_MEAN = "eval/reward_mean"  # the entries' weighted total
EVAL_REWARD_FN_MEAN = "eval/rewards/{}_mean"  # one per entry
EVAL_REWARD_UNSCORABLE = "eval/reward_unscorable"  # greedy completions some entry could not score (None)
EVAL_REWARD_ERRORS = "eval/reward_errors"  # (entry, completion) calls that raised or timed out: scored 0
EVAL_CALLS_PER_EPISODE = "eval/calls_per_episode"  # env != single_turn: mean tool calls of a greedy episode
# eval.group_by: per value <v> of that column (a difficulty bucket), filled with the value.
EVAL_PASS_AT_1_BY = "eval/pass@1/{}"  # greedy correctness, Wilson interval
EVAL_NUM_PROBLEMS_BY = "eval/num_problems/{}"  # the bucket's problems (whose gold parses, when graded)
EVAL_TOOL_CALL_RATE_BY = "eval/tool_call_rate/{}"  # greedy episodes with >= 1 call, Wilson interval
EVAL_CALLS_PER_EPISODE_BY = "eval/calls_per_episode/{}"  # mean greedy calls, bootstrap interval
EVAL_S = "perf/eval_s"  # all held-out sets of one evaluation together
EVAL_KEYS = [EVAL_ACCURACY, EVAL_MEAN_AT_K, EVAL_BOXED_FRACTION, EVAL_COMPLETION_LEN, EVAL_S]
# The rates that carry a 95% interval over problems: `<key>_ci_low`, `<key>_ci_high` (docs/evaluation.md).
EVAL_RATES = [EVAL_ACCURACY, EVAL_MEAN_AT_K, EVAL_PASS_AT_K, EVAL_BOXED_FRACTION]
CI_LOW = "_ci_low"
CI_HIGH = "_ci_high"
# The before/after change (final summary only): problems that went wrong -> right and right -> wrong.
FLIPS_UP = "_flips_up"
FLIPS_DOWN = "_flips_down"
EVAL_ACCURACY_CI_LOW = EVAL_ACCURACY + CI_LOW
EVAL_ACCURACY_CI_HIGH = EVAL_ACCURACY + CI_HIGH
EVAL_MEAN_AT_K_CI_LOW = EVAL_MEAN_AT_K + CI_LOW
EVAL_MEAN_AT_K_CI_HIGH = EVAL_MEAN_AT_K + CI_HIGH
EVAL_PASS_AT_K_CI_LOW = EVAL_PASS_AT_K + CI_LOW
EVAL_PASS_AT_K_CI_HIGH = EVAL_PASS_AT_K + CI_HIGH
EVAL_BOXED_FRACTION_CI_LOW = EVAL_BOXED_FRACTION + CI_LOW
EVAL_BOXED_FRACTION_CI_HIGH = EVAL_BOXED_FRACTION + CI_HIGH
EVAL_REWARD_MEAN_CI_LOW = EVAL_REWARD_MEAN + CI_LOW
EVAL_REWARD_MEAN_CI_HIGH = EVAL_REWARD_MEAN + CI_HIGH
EVAL_ACCURACY_FLIPS_UP = EVAL_ACCURACY + FLIPS_UP
EVAL_ACCURACY_FLIPS_DOWN = EVAL_ACCURACY + FLIPS_DOWN


def eval_key(key: str, dataset: str | None = None) -> str:
    """The key of an eval/* metric for one held-out set of `eval.datasets`: `eval/<dataset>/<rest>`.

    The run's own held-out split (`dataset=None`) keeps the plain `eval/...` keys, so dashboards and the
    sweeper's return value (eval/accuracy) do not change when extra sets are added.
    """
    if dataset is None:
        return key
    assert key.startswith("eval/"), key
    return f"eval/{dataset}/{key[len('eval/') :]}"


# alerts/: the in-flight alarms (grpo_run/tracking/alarms.py), 1.0 at a step where the condition holds.
ALERT_TRUNCATED = "alerts/truncated"  # truncated_fraction >= alerts.truncated_fraction, N steps in a row
ALERT_ALL_WRONG = "alerts/no_signal_all_wrong"  # every group at the reward's minimum, N steps in a row
ALERT_ALL_CORRECT = "alerts/no_signal_all_correct"  # every group at the reward's maximum
ALERT_NO_SIGNAL = "alerts/no_signal"  # every group's rewards equal, neither all min nor all max
ALERT_REWARD_FAILURES = "alerts/reward_failures"  # reward errors + timeouts above a share of completions
ALERT_KL = "alerts/kl"  # train/kl above alerts.kl_max
ALERT_NONFINITE = "alerts/nonfinite"  # updates skipped for a non-finite loss or gradient
ALERT_WEIGHTS_UNCHANGED = "alerts/weights_unchanged"  # grad_norm > 0, yet no trainable parameter moved
ALERT_EMPTY = "alerts/empty_completions"  # completion_len_mean < alerts.empty_length, N steps in a row
ALERT_KEYS = [
    ALERT_TRUNCATED,
    ALERT_ALL_WRONG,
    ALERT_ALL_CORRECT,
    ALERT_NO_SIGNAL,
    ALERT_REWARD_FAILURES,
    ALERT_KL,
    ALERT_NONFINITE,
    ALERT_WEIGHTS_UNCHANGED,
    ALERT_EMPTY,
]

_REWARD_SQ = "_reward_sq"  # internal: E[r^2], turned into train/reward_std by `reduce`
UPDATE_NORM_SQ = "_update_norm_sq"  # internal: summed over updates and ranks, train/update_norm by `reduce`

# Logged at every step whatever the configuration (train/kl only when beta > 0; the update's keys,
# loss, grad_norm, update_norm, clip_fraction*, entropy, are absent on a step whose update dynamic
# sampling skipped; frac_all_correct / frac_all_wrong are absent when a user's reward gives no `range`).
ALWAYS = [
    REWARD_MEAN,
    REWARD_STD,
    FRAC_REWARD_ZERO_STD,
    FRAC_ALL_CORRECT,
    FRAC_ALL_WRONG,
    CLIP_FRACTION,
    CLIP_FRACTION_LOW,
    CLIP_FRACTION_HIGH,
    ENTROPY,
    LOSS,
    GRAD_NORM,
    UPDATE_NORM,
    LR,
    BETA,
    COMPLETION_LEN_MEAN,
    COMPLETION_LEN_MAX,
    TRUNCATED_FRACTION,
    REWARD_ERRORS,
    REWARD_TIMEOUTS,
    DROPPED_GROUPS,
    GENERATION_ROUNDS,
    MASKED_TRUNCATED,
    SCORED_COMPLETIONS,
    TRAINED_COMPLETIONS,
    *DROPPED_KEYS,
    STEP_S,
    GENERATE_S,
    TRAIN_S,
    TOKENS_PER_S,
    PEAK_MEM_GB,
]


# Summed on every rank at every step (so that the ranks' reductions line up), but written only when the
# step's total is above 0: the keys of a run where nothing went wrong stay as they were.
ONLY_WHEN_NONZERO = [REWARD_WORKER_RESTARTS]


class StepMetrics:
    """Weighted means, sums and maxima of one step, kept on device until `reduce`."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._sum: dict[str, torch.Tensor] = {}
        self._count: dict[str, torch.Tensor] = {}
        self._max: dict[str, torch.Tensor] = {}
        self._host: dict[str, float] = {}

    def _t(self, value: torch.Tensor | float) -> torch.Tensor:
        return torch.as_tensor(value, dtype=torch.float64, device=self.device).detach()

    def add_mean(self, key: str, total: torch.Tensor | float, count: torch.Tensor | float) -> None:
        """Contribute `total` over `count` items to the step mean of `key`."""
        for acc, value in ((self._sum, total), (self._count, count)):
            acc[key] = acc[key] + self._t(value) if key in acc else self._t(value)

    def add_sum(self, key: str, value: torch.Tensor | float) -> None:
        """A count or total summed over the step (and over ranks)."""
        self.add_mean(key, value, 0.0)

    def add_max(self, key: str, value: torch.Tensor | float) -> None:
        v = self._t(value)
        self._max[key] = torch.maximum(self._max[key], v) if key in self._max else v

    def set_host(self, key: str, value: float) -> None:
        """A value that already lives on the host (timings); identical on every rank."""
        self._host[key] = float(value)

    def parts(self) -> tuple[dict, dict, dict, dict]:
        """What was accumulated (sums, counts, maxima, host values): how another process's stats travel."""
        return self._sum, self._count, self._max, self._host

    def merge(self, parts: tuple[dict, dict, dict, dict]) -> None:
        """Add another accumulator's `parts` (the generation worker's reward counts) to this one's."""
        sums, counts, maxes, host = parts
        for key, total in sums.items():
            self.add_mean(key, total.to(self.device), counts[key].to(self.device))
        for key, value in maxes.items():
            self.add_max(key, value.to(self.device))
        for key, value in host.items():
            self.set_host(key, value)

    def reduce(self, engine: Engine) -> dict[str, float]:
        """One all-reduce per kind, one host copy: {key: value}."""
        mean_keys = list(self._sum)
        max_keys = list(self._max)
        sums = engine.all_reduce_sum(
            torch.stack([self._sum[k] for k in mean_keys] + [self._count[k] for k in mean_keys])
            if mean_keys
            else torch.zeros(0, dtype=torch.float64, device=self.device)
        )
        maxes = engine.all_reduce_max(
            torch.stack([self._max[k] for k in max_keys])
            if max_keys
            else torch.zeros(0, dtype=torch.float64, device=self.device)
        )
        values = torch.cat([sums, maxes]).tolist()  # the step's single host copy
        n = len(mean_keys)
        out: dict[str, float] = {}
        for i, key in enumerate(mean_keys):
            total, count = values[i], values[n + i]
            if count == 0 and key.startswith(BY_VALUE_PREFIXES):
                continue  # a bucket no rank sampled this step: no mean (every rank added it, to stay aligned)
            out[key] = total / count if count > 0 else total
        for i, key in enumerate(max_keys):
            out[key] = values[2 * n + i]
        if _REWARD_SQ in out:
            # Population std over every completion of the step, from E[r^2] - E[r]^2.
            out[REWARD_STD] = max(out.pop(_REWARD_SQ) - out[REWARD_MEAN] ** 2, 0.0) ** 0.5
        if UPDATE_NORM_SQ in out:
            out[UPDATE_NORM] = out.pop(UPDATE_NORM_SQ) ** 0.5
        for key in ONLY_WHEN_NONZERO:
            if out.get(key) == 0:
                del out[key]
        out.update(self._host)
        return out

    def add_rewards(self, rewards: torch.Tensor, weights: torch.Tensor) -> None:
        """Reward mean and std over the completions with weight 1 (the scorable ones)."""
        self.add_mean(REWARD_MEAN, (rewards * weights).sum(), weights.sum())
        self.add_mean(_REWARD_SQ, (rewards.square() * weights).sum(), weights.sum())
