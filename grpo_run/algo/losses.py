"""The GRPO policy loss (the table of its variants, POLICY_LOSSES) and the aggregations that turn
per-token losses into one scalar.

Shapes: N completions (rows), T completion positions. `mask` [N, T] is bool or float (1 on completion
tokens, 0 on padding and after EOS). Values at masked-out positions never reach a result, even when
they are inf or NaN: they are replaced with 0 before any arithmetic that could spread them.
"""

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, fields
from enum import Enum
from typing import Any, NamedTuple

import torch

from grpo_run.algo.enums import Aggregation, CispoBounds, ImportanceLevel, KLEstimator, PolicyLoss
from grpo_run.algo.kl import kl_divergence

# Log-ratios (token or sequence level) are clamped to this band before exp, so a pathological token
# cannot turn the loss inf; exp(20) ~ 4.9e8 is far beyond any ratio the clip would let through.
LOG_RATIO_CLAMP = 20.0


def _safe_div(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """num / den, and 0 where den == 0 (num is then 0 as well: nothing was summed)."""
    return num / torch.where(den != 0, den, torch.ones_like(den))


def _masked(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """x with masked-out entries set to 0 and kept ones weighted by a float mask. [N, T] -> [N, T]."""
    return torch.where(mask != 0, x, torch.zeros_like(x)) * mask.to(x.dtype)  # [N, T]


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of x over the mask (all of it, or along `dim`); 0 where the mask is empty.

    x, mask: [N, T]. Returns a scalar, or x reduced along `dim`.
    """
    weights = mask.to(x.dtype)  # [N, T]
    if dim is None:
        return _safe_div(_masked(x, mask).sum(), weights.sum())  # []
    return _safe_div(_masked(x, mask).sum(dim), weights.sum(dim))  # x.shape without dim


def _denominator(normalizer: torch.Tensor | float | None, local: torch.Tensor | float, like: torch.Tensor):
    """The step-level normalizer when given, else this batch's own count, as a tensor like `like`."""
    count = local if normalizer is None else normalizer
    return torch.as_tensor(count, dtype=like.dtype, device=like.device)  # []


def _per_token(masked_loss, weights, normalizer, constant_length):
    tokens = _denominator(normalizer, weights.sum(), masked_loss)  # []
    return _safe_div(masked_loss.sum(), tokens)  # []


def _per_response(masked_loss, weights, normalizer, constant_length):
    per_completion = _safe_div(masked_loss.sum(-1), weights.sum(-1))  # [N]
    completions = _denominator(normalizer, float(masked_loss.shape[0]), masked_loss)  # []
    return _safe_div(per_completion.sum(), completions)  # []


def _constant_length(masked_loss, weights, normalizer, constant_length):
    if constant_length is None:
        raise ValueError("aggregation=constant_length needs constant_length (the fixed L), got None")
    per_completion = masked_loss.sum(-1) / constant_length  # [N]
    completions = _denominator(normalizer, float(masked_loss.shape[0]), masked_loss)  # []
    return _safe_div(per_completion.sum(), completions)  # []


# One signature: (masked loss [N, T], mask weights [N, T], normalizer, constant_length) -> scalar.
AggregateFn = Callable[[torch.Tensor, torch.Tensor, object, object], torch.Tensor]

AGGREGATIONS: dict[Aggregation, AggregateFn] = {
    Aggregation.PER_TOKEN: _per_token,
    Aggregation.PER_RESPONSE: _per_response,
    Aggregation.CONSTANT_LENGTH: _constant_length,
}


def aggregate(
    per_token_loss: torch.Tensor,
    mask: torch.Tensor,
    aggregation: Aggregation | str,
    normalizer: torch.Tensor | float | None = None,
    constant_length: float | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss [N, T] over the completion mask [N, T] to a scalar.

    per_response: sum_i (sum_t m l / sum_t m) / normalizer (an empty row adds 0 but still counts);
    per_token: sum m l / normalizer; constant_length: sum_i (sum_t m l / constant_length) / normalizer.
    normalizer is the step-level denominator, so micro-batches (and ranks) that each pass it sum to
    the whole-step loss: per_token -> completion tokens of the step, per_response and
    constant_length -> completions of the step. None uses this batch's own count.
    """
    agg = Aggregation(aggregation)
    weights = mask.to(per_token_loss.dtype)  # [N, T]
    masked_loss = _masked(per_token_loss, mask)  # [N, T]
    return AGGREGATIONS[agg](masked_loss, weights, normalizer, constant_length)  # []


@dataclass(frozen=True)
class LossSettings:
    """Every hyper-parameter of the policy loss that stays fixed for a run (built once from the config).

    beta and the entropy coefficient are not here: a controller may change them between steps, so
    they are runtime arguments of `policy_loss`. docs/algorithm.md describes each knob.
    """

    epsilon: float = 0.2  # lower clip: ratio >= 1 - epsilon
    epsilon_high: float = 0.2  # upper clip: ratio <= 1 + epsilon_high
    aggregation: Aggregation = Aggregation.PER_RESPONSE
    constant_length: float | None = None  # aggregation=constant_length's L
    clip_ratio_c: float | None = None  # clip: dual clip (> 1); dppo_*: the cap of the detached ratio
    kl_estimator: KLEstimator = KLEstimator.K3
    importance_level: ImportanceLevel = ImportanceLevel.TOKEN
    policy_loss: PolicyLoss = PolicyLoss.CLIP
    delta: float | None = None  # clip: INTELLECT-2's two-sided clip, ratio <= delta in the unclipped branch
    cispo_bounds: CispoBounds = CispoBounds.ABSOLUTE
    cispo_cap: float = 5.0  # cispo absolute: the weight is min(ratio, cispo_cap)
    sapo_tau_pos: float = 1.0  # sapo: the gate's temperature for A > 0
    sapo_tau_neg: float = 1.05  # sapo: for A <= 0
    trust_region_low: float = 0.2  # dppo_*: how far p may fall below p_old for A <= 0 (TV or binary KL)
    trust_region_high: float = 0.2  # dppo_*: how far p may rise above p_old for A > 0
    top_entropy_quantile: float = 1.0  # rho: the share of highest-entropy tokens in the surrogate
    off_policy_mask_threshold: float | None = None  # DeepSeek-V3.2: mask A < 0 sequences past this KL
    kl_bias_correction: bool = False  # the KL term multiplied by pi_theta / pi_old (DeepSeek-V3.2)

    def __post_init__(self) -> None:
        # Plain strings from a test or a script become the Enums (the fields' declared types).
        object.__setattr__(self, "aggregation", Aggregation(self.aggregation))
        object.__setattr__(self, "kl_estimator", KLEstimator(self.kl_estimator))
        object.__setattr__(self, "importance_level", ImportanceLevel(self.importance_level))
        object.__setattr__(self, "policy_loss", PolicyLoss(self.policy_loss))
        object.__setattr__(self, "cispo_bounds", CispoBounds(self.cispo_bounds))
        if self.clip_ratio_c is not None and self.clip_ratio_c <= 1.0:
            raise ValueError(f"clip_ratio_c must be > 1 (dual clip), got {self.clip_ratio_c}")
        if not 0.0 < self.top_entropy_quantile <= 1.0:
            raise ValueError(f"top_entropy_quantile must lie in (0, 1], got {self.top_entropy_quantile}")

    @classmethod
    def from_knobs(cls, knobs: Mapping[str, Any]) -> "LossSettings":
        """The settings from the run's knobs by name: every field is the config's grpo key of the same name
        (other keys are ignored), so a new knob is declared in GrpoConfig and here, and copied by itself."""
        values = {f.name: knobs[f.name] for f in fields(cls)}
        # In order: trust_region_high takes epsilon_high once that is resolved.
        for key, fallback in NULL_TAKES.items():
            if values[key] is None:
                values[key] = values[fallback]
        return cls(**values)


# A knob the config leaves null takes another's value: epsilon_high is epsilon, and dppo's trust region
# is the clip's range (verl's default).
NULL_TAKES = {"epsilon_high": "epsilon", "trust_region_low": "epsilon", "trust_region_high": "epsilon_high"}


class PolicyLossOutput(NamedTuple):
    loss: torch.Tensor  # [] aggregated loss, with grad
    kl: torch.Tensor  # [] detached masked mean of the per-token KL (0 when beta == 0 or no ref)
    clip_fraction: torch.Tensor  # [] detached: low + high
    clip_fraction_low: (
        torch.Tensor
    )  # [] detached: share of tokens the surrogate bounds from below (see Surrogate)
    clip_fraction_high: torch.Tensor  # [] detached: share bounded from above
    entropy: torch.Tensor  # [] detached masked mean of the per-token entropy (0 when not given)
    entropy_kept_fraction: torch.Tensor | float = 1.0  # [] share of loss tokens the entropy quantile keeps
    off_policy_masked_fraction: torch.Tensor | float = (
        0.0  # [] share of loss tokens the off-policy mask drops
    )
    trust_region_masked_fraction: torch.Tensor | float = 0.0  # [] dppo_*: share outside the trust region


def _log_ratio(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor, level: ImportanceLevel
) -> torch.Tensor:
    """log(pi_theta / pi_old) per token [N, T], token level or GSPO's sequence level."""
    token = torch.where(mask != 0, logprobs - old_logprobs, torch.zeros_like(logprobs))  # [N, T]
    if level is ImportanceLevel.TOKEN:
        return token.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # [N, T]
    # GSPO-token form: value = the sequence's length-normalised log-ratio on every token, gradient
    # = d log pi_theta(token). Aggregated with equal weights inside a completion (all our modes), the
    # gradient equals GSPO's d s_i = s_i * mean_t d log pi_theta.
    seq = masked_mean(token, mask, dim=-1).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # [N]
    safe_logprobs = torch.where(mask != 0, logprobs, torch.zeros_like(logprobs))  # [N, T]
    return seq.detach().unsqueeze(-1) + safe_logprobs - safe_logprobs.detach()  # [N, T]


def _is_zero(x: torch.Tensor | float) -> bool:
    """True only for a plain number equal to 0; a tensor is never inspected (no host sync)."""
    return not isinstance(x, torch.Tensor) and x == 0


class Surrogate(NamedTuple):
    """One policy loss's per-token objective (to maximise) and where it bounds the update."""

    value: torch.Tensor  # [N, T] with grad
    low: torch.Tensor  # [N, T] bool: bounded from below (clip: ratio < 1 - eps with A < 0)
    high: torch.Tensor  # [N, T] bool: bounded from above (clip: ratio > 1 + eps_high with A > 0)


class SurrogateInputs(NamedTuple):
    ratio: torch.Tensor  # [N, T] pi_theta / pi_old (token or sequence level), with grad
    logprobs: torch.Tensor  # [N, T] log pi_theta, 0 off the mask, with grad
    old_logprobs: torch.Tensor  # [N, T] log pi_old, 0 off the mask
    adv: torch.Tensor  # [N, 1], or [N, T] per-token advantages (on-policy distillation)


def _clip(x: SurrogateInputs, s: LossSettings) -> Surrogate:
    """min(r A, clip(r, 1 - eps, 1 + eps_high) A); delta caps r in the first branch (INTELLECT-2), and
    clip_ratio_c = c raises the A < 0 surrogate to at least c A (dual clip)."""
    ratio, adv = x.ratio, x.adv
    capped = ratio if s.delta is None else ratio.clamp(max=s.delta)  # [N, T]
    unclipped = capped * adv  # [N, T]
    clipped = ratio.clamp(1.0 - s.epsilon, 1.0 + s.epsilon_high) * adv  # [N, T]
    surrogate = torch.minimum(unclipped, clipped)  # [N, T]
    if s.clip_ratio_c is not None:
        # For A < 0 the unclipped branch is unbounded below as the ratio grows; cap the loss at -c A.
        surrogate = torch.where(adv < 0, torch.maximum(surrogate, s.clip_ratio_c * adv), surrogate)  # [N, T]
    with torch.no_grad():
        low = (ratio < 1.0 - s.epsilon) & (adv < 0)  # [N, T]
        high = (ratio > 1.0 + s.epsilon_high) & (adv > 0)  # [N, T]
    return Surrogate(surrogate, low, high)


def _cispo_bounds(s: LossSettings) -> tuple[float | None, float]:
    if s.cispo_bounds is CispoBounds.ABSOLUTE:
        return None, s.cispo_cap
    return 1.0 - s.epsilon, 1.0 + s.epsilon_high


def _cispo(x: SurrogateInputs, s: LossSettings) -> Surrogate:
    """sg(w) A log pi_theta with w the ratio clipped (CISPO): the gradient w A d log pi reaches every
    token, clipping only bounds its weight. low/high: tokens whose weight was raised / lowered."""
    lower, upper = _cispo_bounds(s)
    weight = x.ratio.detach().clamp(min=lower, max=upper)  # [N, T]
    with torch.no_grad():
        high = x.ratio > upper  # [N, T]
        low = x.ratio < lower if lower is not None else torch.zeros_like(high)  # [N, T]
    return Surrogate(weight * x.adv * x.logprobs, low, high)


def _sapo(x: SurrogateInputs, s: LossSettings) -> Surrogate:
    """f(r) A with the soft gate f(r) = sigmoid(tau (r - 1)) 4 / tau, tau_pos for A > 0 else tau_neg:
    f(1) = 2 / tau and f'(1) = 1, the gradient fades smoothly as r leaves 1. Nothing is hard-clipped."""
    pos, neg = x.ratio.new_tensor(s.sapo_tau_pos), x.ratio.new_tensor(s.sapo_tau_neg)  # [], []
    tau = torch.where(x.adv > 0, pos, neg)  # [N, 1]
    gate = torch.sigmoid(tau * (x.ratio - 1.0)) * (4.0 / tau)  # [N, T]
    none = torch.zeros_like(x.ratio, dtype=torch.bool)  # [N, T]
    return Surrogate(gate * x.adv, none, none)


def _dppo(x: SurrogateInputs, s: LossSettings, inside: torch.Tensor) -> Surrogate:
    """sg(min(r, c)) A log pi_theta on the tokens inside the trust region (`inside`, per A's sign), 0
    outside: verl's DPPO surrogate (c = clip_ratio_c, none when null). low/high: tokens masked with
    A <= 0 / A > 0."""
    weight = x.ratio.detach()  # [N, T]
    if s.clip_ratio_c is not None:
        weight = weight.clamp(max=s.clip_ratio_c)  # [N, T]
    keep = inside.to(weight.dtype)  # [N, T]
    with torch.no_grad():
        low = ~inside & (x.adv <= 0)  # [N, T]
        high = ~inside & (x.adv > 0)  # [N, T]
    return Surrogate(weight * x.adv * x.logprobs * keep, low, high)


def _dppo_tv(x: SurrogateInputs, s: LossSettings) -> Surrogate:
    """Trust region by total variation on the sampled token: p - p_old <= high (A > 0), >= -low (A <= 0)."""
    with torch.no_grad():
        change = torch.exp(x.logprobs) - torch.exp(x.old_logprobs)  # [N, T]
        inside = torch.where(x.adv > 0, change <= s.trust_region_high, change >= -s.trust_region_low)
    return _dppo(x, s, inside)


# 1 - p can round to 0 for a near-certain token; this keeps its log finite (verl's constant).
BINARY_KL_EPS = 1e-8


def binary_kl(old_logprobs: torch.Tensor, logprobs: torch.Tensor) -> torch.Tensor:
    """KL(Bernoulli(p_old) || Bernoulli(p)) of the sampled token's probability. [N, T] -> [N, T]."""
    p, p_old = torch.exp(logprobs), torch.exp(old_logprobs)  # [N, T]
    rest = torch.log((1.0 - p_old + BINARY_KL_EPS) / (1.0 - p + BINARY_KL_EPS))  # [N, T]
    return p_old * (old_logprobs - logprobs) + (1.0 - p_old) * rest  # [N, T]


def _dppo_kl(x: SurrogateInputs, s: LossSettings) -> Surrogate:
    """Trust region by the binary KL: a token moving towards A's sign stays while KL <= the bound."""
    with torch.no_grad():
        kl = binary_kl(x.old_logprobs, x.logprobs)  # [N, T]
        p, p_old = torch.exp(x.logprobs), torch.exp(x.old_logprobs)  # [N, T]
        up = (kl <= s.trust_region_high) | (p <= p_old)  # [N, T]
        down = (kl <= s.trust_region_low) | (p >= p_old)  # [N, T]
        inside = torch.where(x.adv > 0, up, down)  # [N, T]
    return _dppo(x, s, inside)


# One signature: (ratio, log-probs, old log-probs, advantages [N, 1]; settings) -> Surrogate.
SurrogateFn = Callable[[SurrogateInputs, LossSettings], Surrogate]


class KnobProblem(NamedTuple):
    """A policy-loss setting that cannot run. key, other: knobs by name (the config's grpo keys and the
    LossSettings fields); other: set when the problem is the combination with that knob's value."""

    key: str
    value: object
    why: str
    other: str | None = None
    other_value: object = None


# (the run's knobs by name, as the config holds them: nulls unresolved; whether this variant is the one
# chosen) -> its problems, in the order they are reported.
KnobCheck = Callable[[Mapping[str, Any], bool], Iterator[KnobProblem]]
# (share of loss tokens bounded from below, from above) -> one of a variant's own metrics [].
VariantMetric = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _no_checks(knobs: Mapping[str, Any], chosen: bool) -> Iterator[KnobProblem]:
    return iter(())


@dataclass(frozen=True)
class LossVariant:
    """One grpo.policy_loss: its surrogate, the knobs it alone reads, their checks, the metrics it adds."""

    surrogate: SurrogateFn
    knobs: tuple[str, ...] = ()  # LossSettings fields (and grpo keys) no other variant family reads
    # Knobs of `knobs` that stay null unless a variant reading them is chosen; set under another variant,
    # they are refused for this reason.
    exclusive: tuple[str, ...] = ()
    exclusive_why: str = ""
    check: KnobCheck = _no_checks  # value checks, and refusals of shared knobs when this variant is chosen
    metrics: dict[str, VariantMetric] = field(default_factory=dict)  # PolicyLossOutput field -> its value


def _plain(value: object) -> object:
    """An Enum member as its value (how the config writes it), anything else as it is."""
    return value.value if isinstance(value, Enum) else value


def _refused(key: str, knobs: Mapping[str, Any], why: str, other: str = "policy_loss") -> KnobProblem:
    """`key` is set, and cannot be combined with the value of `other` (the chosen policy loss by default)."""
    return KnobProblem(key, _plain(knobs[key]), why, other, _plain(knobs[other]))


def _clip_checks(knobs: Mapping[str, Any], chosen: bool) -> Iterator[KnobProblem]:
    """delta: instead of a dual clip, and above the clip's own upper bound."""
    delta, c = knobs["delta"], knobs["clip_ratio_c"]
    if delta is None:
        return
    if c is not None:
        why = (
            "both cap the A < 0 surrogate at the same place (delta A = dual clip with c = delta); choose one"
        )
        yield KnobProblem("delta", delta, why, "clip_ratio_c", c)
    eps_high = knobs["epsilon"] if knobs["epsilon_high"] is None else knobs["epsilon_high"]
    if not delta > 1 + eps_high:
        why = (
            f"must be > 1 + grpo.epsilon_high = {1 + eps_high} (below it the two-sided clip cuts into the "
            "trust region of the ordinary clip)"
        )
        yield KnobProblem("delta", delta, why)


def _sapo_checks(knobs: Mapping[str, Any], chosen: bool) -> Iterator[KnobProblem]:
    """sapo replaces the hard clip; its temperatures are positive."""
    for key in ("clip_ratio_c", "epsilon_high"):
        if chosen and knobs[key] is not None:
            yield _refused(key, knobs, "sapo's soft gate replaces the hard clip")
    for key in ("sapo_tau_pos", "sapo_tau_neg"):
        if not knobs[key] > 0:
            yield KnobProblem(key, knobs[key], "must be > 0 (a temperature)")


def _cispo_checks(knobs: Mapping[str, Any], chosen: bool) -> Iterator[KnobProblem]:
    """cispo's weight is already clipped (no dual clip); under the absolute cap, epsilon_high is unused."""
    if chosen and knobs["clip_ratio_c"] is not None:
        why = "cispo's weight is detached and already clipped; a dual clip has nothing to bound"
        yield _refused("clip_ratio_c", knobs, why)
    absolute = knobs["cispo_bounds"] == CispoBounds.ABSOLUTE
    if chosen and absolute and knobs["epsilon_high"] is not None:
        why = (
            "the absolute cap is grpo.cispo_cap (TRL's epsilon_high); use cispo_bounds=relative for "
            "verl's [1 - epsilon, 1 + epsilon_high]"
        )
        yield _refused("epsilon_high", knobs, why, other="cispo_bounds")
    if not knobs["cispo_cap"] > 0:
        yield KnobProblem("cispo_cap", knobs["cispo_cap"], "must be > 0 (the cap on the ratio)")


def _dppo_checks(knobs: Mapping[str, Any], chosen: bool) -> Iterator[KnobProblem]:
    """The trust region's bounds are positive and per token, so the ratio must be too."""
    if not chosen:
        return
    for key in TRUST_REGION:
        if knobs[key] is not None and not knobs[key] > 0:
            yield KnobProblem(key, knobs[key], "must be > 0")
    if knobs["importance_level"] == ImportanceLevel.SEQUENCE:
        yield _refused("importance_level", knobs, "dppo's trust region is on each token's probability")


TRUST_REGION = ("trust_region_low", "trust_region_high")


def _outside_trust_region(low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    """The share of loss tokens outside dppo's trust region: its low/high shares are the masked tokens
    with A <= 0 and with A > 0."""
    return low + high  # []


def _dppo_variant(surrogate: SurrogateFn) -> LossVariant:
    return LossVariant(
        surrogate,
        knobs=TRUST_REGION,
        exclusive=TRUST_REGION,
        exclusive_why="only dppo_tv and dppo_kl have a trust region",
        check=_dppo_checks,
        metrics={"trust_region_masked_fraction": _outside_trust_region},
    )


# The policy losses, in the order their checks report (the first problem found is the error shown).
POLICY_LOSSES: dict[PolicyLoss, LossVariant] = {
    PolicyLoss.CLIP: LossVariant(
        _clip,
        knobs=("delta",),
        exclusive=("delta",),
        exclusive_why="delta bounds clip's ratio",
        check=_clip_checks,
    ),
    PolicyLoss.SAPO: LossVariant(_sapo, knobs=("sapo_tau_pos", "sapo_tau_neg"), check=_sapo_checks),
    PolicyLoss.CISPO: LossVariant(_cispo, knobs=("cispo_bounds", "cispo_cap"), check=_cispo_checks),
    PolicyLoss.DPPO_TV: _dppo_variant(_dppo_tv),
    PolicyLoss.DPPO_KL: _dppo_variant(_dppo_kl),
}


def knob_problems(knobs: Mapping[str, Any]) -> Iterator[KnobProblem]:
    """The problems of the policy-loss knobs (by name, as the config holds them), first reported first:
    per variant, its exclusive knobs set under a variant that does not read them, then its checks."""
    chosen = PolicyLoss(knobs["policy_loss"])
    reads = POLICY_LOSSES[chosen].knobs
    for name, variant in POLICY_LOSSES.items():
        for key in variant.exclusive:
            if knobs[key] is not None and key not in reads:
                yield _refused(key, knobs, variant.exclusive_why)
        yield from variant.check(knobs, name is chosen)


def high_entropy_mask(entropy: torch.Tensor, mask: torch.Tensor, rho: float) -> torch.Tensor:
    """Bool [N, T]: completion tokens whose entropy is at least the (1 - rho) quantile of this batch's
    completion-token entropies (linear interpolation, torch.quantile), i.e. the top-rho share."""
    on = mask != 0  # [N, T]
    values = entropy.detach().float()[on]  # [n]
    if values.numel() == 0:
        return torch.zeros_like(on)
    threshold = torch.quantile(values, 1.0 - rho)  # []
    return (entropy.detach().float() >= threshold) & on  # [N, T]


def off_policy_sequence_mask(
    advantages: torch.Tensor,
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    mask: torch.Tensor,
    threshold: float,
) -> torch.Tensor:
    """Bool [N]: keep a completion unless A < 0 and mean_t (log pi_behaviour - log pi_theta) > threshold
    (DeepSeek-V3.2 eq. 9). advantages [N]; the rest [N, T]."""
    kl = masked_mean(behaviour_logprobs.detach() - logprobs.detach(), mask, dim=-1)  # [N]
    return (advantages >= 0) | (kl <= threshold)  # [N]


class LossInputs(NamedTuple):
    """One batch's per-token tensors of the policy loss: N completions, T completion positions."""

    logprobs: torch.Tensor  # [N, T] log pi_theta, with grad
    old_logprobs: torch.Tensor  # [N, T] log pi_old
    advantages: torch.Tensor  # [N], or [N, T] per token (distill.form=advantage)
    mask: torch.Tensor  # [N, T] the loss tokens
    ref_logprobs: torch.Tensor | None = None  # [N, T] log pi_ref; None: no KL term
    entropy: torch.Tensor | None = None  # [N, T] per-token entropy (the quantile mask, the bonus, a metric)
    token_weights: torch.Tensor | None = None  # [N, T] detached surrogate weights (rollout_correction.py)
    behaviour_logprobs: torch.Tensor | None = None  # [N, T] the sampler's, for the off-policy mask


class Kept(NamedTuple):
    """What the composing masks keep of the surrogate (None: that mask is off)."""

    tokens: torch.Tensor | None  # [N, T] bool: the top-entropy quantile
    sequences: torch.Tensor | None  # [N, 1] bool: the off-policy sequence mask


class Terms(NamedTuple):
    """The per-token terms the metrics are taken from."""

    ratio: torch.Tensor  # [N, T] pi_theta / pi_old
    kl: torch.Tensor  # [N, T] the KL estimate, 0 without a KL term
    entropy: torch.Tensor  # [N, T] masked entropy, 0 when not given


def policy_loss(
    x: LossInputs,
    settings: LossSettings,
    *,
    beta: torch.Tensor | float,
    normalizer: torch.Tensor | float | None = None,
    entropy_coef: torch.Tensor | float = 0.0,
) -> PolicyLossOutput:
    """The GRPO policy loss of one batch `x` (LossInputs: log-probs, advantages [N], mask, ...).

    ratio = exp(log pi_theta - log pi_old) per token (importance_level="sequence": GSPO's
    exp(mean_t log-ratio) shared by the completion's tokens); the surrogate is
    POLICY_LOSSES[settings.policy_loss] (clip: min(ratio A, clip(ratio, 1 - eps, 1 + eps_high) A)),
    then `kept_surrogate`'s masks and weights. Per-token loss
    l = -(surrogate - beta kl) - entropy_coef H (kl times the ratio under kl_bias_correction; H over
    the tokens the entropy mask keeps), then `aggregate` with the step's `normalizer`. Metrics are
    detached masked means over this batch's completion tokens.
    """
    s, mask = settings, x.mask
    ratio = torch.exp(_log_ratio(x.logprobs, x.old_logprobs, mask, s.importance_level))  # [N, T]
    on = mask != 0  # [N, T]
    inputs = SurrogateInputs(
        ratio=ratio,
        logprobs=torch.where(on, x.logprobs, torch.zeros_like(x.logprobs)),
        old_logprobs=torch.where(on, x.old_logprobs, torch.zeros_like(x.old_logprobs)),
        adv=_per_token_or_row(x.advantages.to(ratio.dtype)),  # [N, 1] or [N, T]
    )
    sur = POLICY_LOSSES[s.policy_loss].surrogate(inputs, s)
    surrogate, kept = kept_surrogate(sur.value, x, s)  # [N, T]
    per_token = -surrogate  # [N, T]

    kl = torch.zeros_like(ratio)  # [N, T]
    if x.ref_logprobs is not None and not _is_zero(beta):
        kl = _kl_term(x, ratio, s)  # [N, T]
        per_token = per_token + beta * kl  # [N, T]

    ent = torch.zeros_like(ratio) if x.entropy is None else _masked(x.entropy, mask)  # [N, T]
    if x.entropy is not None and not _is_zero(entropy_coef):
        bonus = ent if kept.tokens is None else ent * kept.tokens.to(ent.dtype)  # [N, T]
        per_token = per_token - entropy_coef * bonus  # [N, T]

    loss = aggregate(per_token, mask, s.aggregation, normalizer=normalizer, constant_length=s.constant_length)
    with torch.no_grad():
        return _output(loss, sur, Terms(ratio, kl, ent), mask, beta, kept, POLICY_LOSSES[s.policy_loss])


def _per_token_or_row(advantages: torch.Tensor) -> torch.Tensor:
    """A row's advantage [N] as [N, 1] (broadcast over its tokens); per-token advantages [N, T] (on-policy
    distillation, `algo/distill.py`) as they are."""
    return advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages


def kept_surrogate(surrogate: torch.Tensor, x: LossInputs, s: LossSettings) -> tuple[torch.Tensor, Kept]:
    """The surrogate [N, T] times the top-entropy mask (top_entropy_quantile < 1, from `x.entropy`), the
    off-policy sequence mask (off_policy_mask_threshold, against `x.behaviour_logprobs`, else
    old_logprobs) and `x.token_weights` (detached, e.g. the sampler correction of
    `rollout_correction.py`), as TRL and verl weight them; and the masks that were on."""
    entropy_keep = None
    if s.top_entropy_quantile < 1.0:
        if x.entropy is None:
            raise ValueError("top_entropy_quantile < 1 needs the per-token entropy")
        entropy_keep = high_entropy_mask(x.entropy, x.mask, s.top_entropy_quantile)  # [N, T]
        surrogate = surrogate * entropy_keep.to(surrogate.dtype)  # [N, T]
    seq_keep = None
    if s.off_policy_mask_threshold is not None:
        behaviour = x.old_logprobs if x.behaviour_logprobs is None else x.behaviour_logprobs  # [N, T]
        seq_keep = off_policy_sequence_mask(
            x.advantages, x.logprobs, behaviour, x.mask, s.off_policy_mask_threshold
        ).unsqueeze(-1)  # [N, 1]
        surrogate = surrogate * seq_keep.to(surrogate.dtype)  # [N, T]
    if x.token_weights is not None:
        surrogate = surrogate * x.token_weights.detach().to(surrogate.dtype)  # [N, T]
    return surrogate, Kept(entropy_keep, seq_keep)


def _kl_term(x: LossInputs, ratio: torch.Tensor, s: LossSettings) -> torch.Tensor:
    """The per-token KL estimate to pi_ref [N, T] (times the ratio under kl_bias_correction)."""
    # Both sides zeroed off the mask: d = 0 there, so padding garbage cannot reach a gradient.
    on = x.mask != 0  # [N, T]
    safe_lp = torch.where(on, x.logprobs, torch.zeros_like(x.logprobs))  # [N, T]
    safe_ref = torch.where(on, x.ref_logprobs, torch.zeros_like(x.ref_logprobs))  # [N, T]
    kl = kl_divergence(safe_lp, safe_ref, s.kl_estimator)  # [N, T]
    if s.kl_bias_correction:
        kl = kl * ratio  # [N, T] the ratio keeps its gradient, as TRL's use_bias_correction_kl
    return kl


def _output(loss, sur: Surrogate, t: Terms, mask, beta, kept: Kept, variant: LossVariant) -> PolicyLossOutput:
    """The loss and its detached metrics: masked means over the batch's loss tokens."""
    dtype = t.ratio.dtype
    frac_low = masked_mean(sur.low.to(dtype), mask)  # []
    frac_high = masked_mean(sur.high.to(dtype), mask)  # []
    kl_mean = masked_mean(t.kl, mask)  # []
    if isinstance(beta, torch.Tensor):
        kl_mean = kl_mean * (beta != 0)  # [] a zero beta tensor reports 0, without a host sync
    extra = {name: metric(frac_low, frac_high) for name, metric in variant.metrics.items()}
    if kept.tokens is not None:
        extra["entropy_kept_fraction"] = masked_mean(kept.tokens.to(dtype), mask)
    if kept.sequences is not None:
        dropped = (~kept.sequences).to(dtype).expand_as(t.ratio)  # [N, T]
        extra["off_policy_masked_fraction"] = masked_mean(dropped, mask)
    return PolicyLossOutput(
        loss=loss,
        kl=kl_mean,
        clip_fraction=frac_low + frac_high,
        clip_fraction_low=frac_low,
        clip_fraction_high=frac_high,
        entropy=masked_mean(t.entropy.detach(), mask),
        **extra,
    )
