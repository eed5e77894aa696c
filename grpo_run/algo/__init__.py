"""Pure GRPO math: tensors in, tensors out; hyper-parameters as keyword arguments."""

from grpo_run.algo.advantages import (
    ADVANTAGE_FUNCTIONS,
    GroupStats,
    compute_advantages,
    group_stats,
    normalize_then_sum,
    zero_std_groups,
)
from grpo_run.algo.entropy_control import applied_entropy_coef, next_entropy_coef
from grpo_run.algo.enums import (
    AdvantageMode,
    Aggregation,
    CispoBounds,
    EntropyControl,
    ImportanceLevel,
    KLEstimator,
    OffPolicyLoss,
    PolicyLoss,
    RewardAggregation,
    RolloutCorrection,
    StdCorrection,
)
from grpo_run.algo.kl import KL_ESTIMATORS, kl_divergence, kl_k1, kl_k2, kl_k3
from grpo_run.algo.kl_control import adaptive_beta
from grpo_run.algo.logprobs import (
    token_entropy,
    token_logprobs,
    token_logprobs_and_entropy,
)
from grpo_run.algo.losses import (
    AGGREGATIONS,
    POLICY_LOSSES,
    LossSettings,
    PolicyLossOutput,
    aggregate,
    binary_kl,
    high_entropy_mask,
    masked_mean,
    off_policy_sequence_mask,
    policy_loss,
)
from grpo_run.algo.rollout_correction import (
    CorrectionWeights,
    MismatchStats,
    mismatch_stats,
    rollout_correction_weights,
)

__all__ = [
    "ADVANTAGE_FUNCTIONS",
    "AGGREGATIONS",
    "KL_ESTIMATORS",
    "POLICY_LOSSES",
    "AdvantageMode",
    "CispoBounds",
    "EntropyControl",
    "LossSettings",
    "OffPolicyLoss",
    "PolicyLoss",
    "RewardAggregation",
    "applied_entropy_coef",
    "binary_kl",
    "high_entropy_mask",
    "next_entropy_coef",
    "normalize_then_sum",
    "off_policy_sequence_mask",
    "CorrectionWeights",
    "MismatchStats",
    "RolloutCorrection",
    "Aggregation",
    "GroupStats",
    "ImportanceLevel",
    "KLEstimator",
    "PolicyLossOutput",
    "StdCorrection",
    "adaptive_beta",
    "aggregate",
    "compute_advantages",
    "group_stats",
    "kl_divergence",
    "kl_k1",
    "kl_k2",
    "kl_k3",
    "masked_mean",
    "mismatch_stats",
    "policy_loss",
    "rollout_correction_weights",
    "token_entropy",
    "token_logprobs",
    "token_logprobs_and_entropy",
    "zero_std_groups",
]
