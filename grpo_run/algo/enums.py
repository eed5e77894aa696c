"""The names of every swappable piece of the math, shared by config and algo.

Each is a plain `StrEnum`, so that a YAML value, a CLI override and the member compare equal. That the
config may write a member by its value is OmegaConf's business and lives in `grpo_run/config/enums.py`.
"""

from enum import StrEnum


class AdvantageMode(StrEnum):
    NORMALIZED = "normalized"  # (r - mean) / (std + eps), the GRPO paper
    CENTERED = "centered"  # r - mean (Dr. GRPO)
    RAW = "raw"  # r
    RLOO = "rloo"  # r_i - mean of the other valid members (leave-one-out baseline)
    NORMALIZED_BATCH = "normalized_batch"  # (r - group mean) / (std over the whole step + eps)


class StdCorrection(StrEnum):
    POPULATION = "population"  # divide squared deviations by G
    SAMPLE = "sample"  # divide by G - 1 (Bessel), as TRL does


class Aggregation(StrEnum):
    PER_RESPONSE = "per_response"  # mean over completions of the per-completion token mean
    PER_TOKEN = "per_token"  # sum over all tokens of the step / token count of the step (DAPO)
    CONSTANT_LENGTH = (
        "constant_length"  # per completion token sum / constant L, mean over completions (Dr. GRPO)
    )


class KLEstimator(StrEnum):
    """Per-token estimators of KL(pi_theta || pi_ref) from samples of pi_theta (Schulman)."""

    K1 = "k1"  # log pi_theta - log pi_ref (unbiased, can be negative)
    K2 = "k2"  # (log pi_ref - log pi_theta)^2 / 2
    K3 = "k3"  # exp(d) - d - 1 with d = log pi_ref - log pi_theta (unbiased, >= 0)


class ImportanceLevel(StrEnum):
    """Where the importance ratio pi_theta / pi_old is formed."""

    TOKEN = "token"  # one ratio per token (GRPO, PPO)
    SEQUENCE = "sequence"  # one length-normalised ratio per completion, shared by its tokens (GSPO)


class RolloutCorrection(StrEnum):
    """How the sampler/trainer mismatch rho_s = pi_old / pi_sampler reweights the surrogate (TRL 1.16's
    `vllm_importance_sampling_mode`, verl's `rollout_correction`); docs/vllm.md."""

    NONE = "none"  # weight 1 everywhere
    TOKEN_TIS = (
        "token_tis"  # per-token rho_s, truncated at the cap (TRL token_truncate, verl rollout_is=token)
    )
    SEQUENCE_TIS = "sequence_tis"  # prod_t rho_s of the completion, truncated (TRL sequence_truncate)
    TOKEN_MASK = "token_mask"  # per-token rho_s, 0 where it exceeds the cap (TRL token_mask)
    SEQUENCE_MASK = "sequence_mask"  # the completion's prod_t rho_s, 0 above the cap (TRL's default)


class PolicyLoss(StrEnum):
    """The per-token surrogate of the policy loss (`algo/losses.py`, POLICY_LOSSES); docs/algorithm.md."""

    CLIP = "clip"  # PPO's clipped ratio (GRPO, DAPO, GSPO), optionally two-sided (delta) or dual-clipped
    CISPO = "cispo"  # MiniMax-M1: sg(clipped ratio) * A * log pi_theta, every token keeps its gradient
    SAPO = "sapo"  # soft gate sigmoid(tau (ratio - 1)) * 4 / tau instead of the hard clip
    DPPO_TV = (
        "dppo_tv"  # DPPO: sg(ratio) * A * log pi_theta, tokens outside a |p - p_old| trust region masked
    )
    DPPO_KL = "dppo_kl"  # DPPO: the same, trust region by the binary KL of (p_old, p)


class CispoBounds(StrEnum):
    """Where CISPO clips its importance weight (the peers differ)."""

    ABSOLUTE = "absolute"  # min(ratio, cispo_cap): TRL's loss_type="cispo" (epsilon_high is the cap)
    RELATIVE = "relative"  # clip(ratio, 1 - epsilon, 1 + epsilon_high): verl's cispo


class EntropyControl(StrEnum):
    FIXED = "fixed"  # the bonus coefficient is grpo.entropy_coef throughout
    ADAPTIVE = "adaptive"  # Skywork-OR1: steered by +-entropy_coef_delta towards entropy_target


class RewardAggregation(StrEnum):
    """How several reward functions become one advantage (TRL's `multi_objective_aggregation`)."""

    SUM_THEN_NORMALIZE = "sum_then_normalize"  # weighted sum of the rewards, then the advantage mode
    NORMALIZE_THEN_SUM = "normalize_then_sum"  # GDPO: each function normalised in its group, then summed


class OffPolicyLoss(StrEnum):
    """pi_old of the clipped ratio when the rows carry their sampler's log-probs (rollout=async, vLLM)."""

    # AReaL's decoupled PPO: the ratio against pi_prox (the trainer's weights the update starts from),
    # times the behaviour weight pi_prox / pi_behaviour bounded by grpo.rollout_correction and its cap.
    DECOUPLED = "decoupled"
    # The ratio taken against the sampler's log-probs themselves: clipping alone bounds the correction.
    BYPASS = "bypass"


class DistillForm(StrEnum):
    """How the teacher enters the update (`algo/distill.py`, the table `DISTILL_FORMS`)."""

    # -coef (log pi_student - log pi_teacher) per token added to the advantage (Tinker; verl's
    # use_policy_gradient), optionally summed over later tokens with a discount.
    ADVANTAGE = "advantage"
    # The exact divergence of the full next-token distributions at each sampled position (on-policy GKD,
    # TRL's generalized JSD with distill.jsd_beta) added to the loss with coef.
    DISTRIBUTION = "distribution"
