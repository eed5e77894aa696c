"""KL estimators, aggregation, the clipped policy loss and the adaptive KL controller."""

import math
import random

import pytest
import torch

from grpo_run.algo import (
    AGGREGATIONS,
    KL_ESTIMATORS,
    Aggregation,
    KLEstimator,
    adaptive_beta,
    aggregate,
    kl_divergence,
    kl_k1,
    kl_k2,
    kl_k3,
    masked_mean,
)
from tests.algo.loss_call import loss_with

TOL = 1e-4


def t(x, dtype=torch.float32):
    return torch.tensor(x, dtype=dtype)


def close(got, expected, tol=TOL):
    if isinstance(got, tuple):
        got = torch.stack(got)
    torch.testing.assert_close(got, torch.as_tensor(expected, dtype=got.dtype), atol=tol, rtol=0)


def loss_of(log_ratio, advantage, *, epsilon=0.2, epsilon_high=None, **kw):
    """Policy loss of completions whose tokens have the given log pi_theta - log pi_old."""
    log_ratio = t(log_ratio)  # [N, T]
    old = torch.full_like(log_ratio, -2.0)  # [N, T]
    kw.setdefault("beta", 0.0)
    kw.setdefault("aggregation", "per_token")
    return loss_with(
        old + log_ratio,
        old,
        None,
        t(advantage),
        torch.ones_like(log_ratio, dtype=torch.bool),
        epsilon=epsilon,
        epsilon_high=epsilon if epsilon_high is None else epsilon_high,
        **kw,
    )


# --- KL estimators ----------------------------------------------------------------------------------


def test_k3_design_numbers():
    # d = log pi_ref - log pi_theta. d = 0 -> e^0 - 0 - 1 = 0
    close(kl_k3(t([[-1.3]]), t([[-1.3]])), [[0.0]])
    # pi_theta = 0.25, pi_ref = 0.5 -> d = ln 2 -> 2 - 0.693147 - 1 = 0.306853
    close(kl_k3(t([[math.log(0.25)]]), t([[math.log(0.5)]])), [[0.3069]])


def test_k1_k2_k3_by_hand():
    # log pi_theta = -1, log pi_ref = -1.5 -> d = -0.5
    # k1 = -d = 0.5; k2 = 0.25/2 = 0.125; k3 = e^-0.5 + 0.5 - 1 = 0.606531 - 0.5 = 0.106531
    lp, ref = t([[-1.0]]), t([[-1.5]])
    close(kl_k1(lp, ref), [[0.5]])
    close(kl_k2(lp, ref), [[0.125]])
    close(kl_k3(lp, ref), [[0.106531]])
    for name, fn in [("k1", kl_k1), ("k2", kl_k2), ("k3", kl_k3)]:
        assert torch.equal(kl_divergence(lp, ref, name), fn(lp, ref))
        assert torch.equal(kl_divergence(lp, ref, KLEstimator(name)), fn(lp, ref))
    assert set(KL_ESTIMATORS) == set(KLEstimator)


def test_k3_clamped_stays_finite():
    # d = 1000 would overflow exp; clamped to 20: e^20 - 20 - 1
    got = kl_k3(t([[-1000.0]]), t([[0.0]]))
    assert torch.isfinite(got).all()
    close(got / math.exp(20), [[(math.exp(20) - 21) / math.exp(20)]])


# --- aggregation ------------------------------------------------------------------------------------

LOSS = [[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]]
MASK = [[1, 1, 1], [1, 0, 0]]


def test_aggregation_design_example():
    # per_token: (1 + 2 + 3 + 4) / 4 tokens = 2.5
    # per_response: ((1 + 2 + 3)/3 + 4/1) / 2 completions = (2 + 4)/2 = 3.0
    close(aggregate(t(LOSS), t(MASK), "per_token"), 2.5)
    close(aggregate(t(LOSS), t(MASK).bool(), Aggregation.PER_RESPONSE), 3.0)


def test_constant_length_by_hand():
    # L = 4: completion sums 6 and 4 -> (6/4 + 4/4) / 2 = (1.5 + 1)/2 = 1.25
    close(aggregate(t(LOSS), t(MASK), "constant_length", constant_length=4), 1.25)
    with pytest.raises(ValueError, match="constant_length"):
        aggregate(t(LOSS), t(MASK), "constant_length")


def test_normalizer_by_hand():
    # per_token over a step of 10 tokens: 10 / 10 = 1.0; per_response over 4 completions: (2 + 4)/4 = 1.5
    close(aggregate(t(LOSS), t(MASK), "per_token", normalizer=10), 1.0)
    close(aggregate(t(LOSS), t(MASK), "per_response", normalizer=t(4.0)), 1.5)
    # constant_length L = 4 over 5 completions: (1.5 + 1)/5 = 0.5
    close(aggregate(t(LOSS), t(MASK), "constant_length", normalizer=5, constant_length=4), 0.5)


def test_empty_mask_row_counts_as_a_completion():
    # row 1 has no token: per_response = (6/3 + 0)/2 = 1.0; per_token = 6/3 = 2.0; constant L=3: (2 + 0)/2 = 1
    mask = t([[1, 1, 1], [0, 0, 0]])
    close(aggregate(t(LOSS), mask, "per_response"), 1.0)
    close(aggregate(t(LOSS), mask, "per_token"), 2.0)
    close(aggregate(t(LOSS), mask, "constant_length", constant_length=3), 1.0)


@pytest.mark.parametrize("agg", list(Aggregation))
def test_all_empty_mask_is_zero_not_nan(agg):
    got = aggregate(t(LOSS), torch.zeros(2, 3), agg, constant_length=3)
    assert torch.equal(got, t(0.0))
    assert torch.equal(masked_mean(t(LOSS), torch.zeros(2, 3)), t(0.0))


def test_masked_mean():
    # (1 + 2 + 3 + 4)/4 = 2.5; per row: 6/3 = 2, 4/1 = 4
    close(masked_mean(t(LOSS), t(MASK)), 2.5)
    close(masked_mean(t(LOSS), t(MASK).bool(), dim=-1), [2.0, 4.0])


def test_aggregation_table():
    assert set(AGGREGATIONS) == set(Aggregation)


def aggregate_loop(loss, mask, agg, constant_length):
    per_completion, total, tokens = [], 0.0, 0.0
    for lrow, mrow in zip(loss, mask):
        s = sum(x * m for x, m in zip(lrow, mrow))
        n = sum(mrow)
        total, tokens = total + s, tokens + n
        if agg == "per_response":
            per_completion.append(s / n if n else 0.0)
        else:
            per_completion.append(s / constant_length)
    if agg == "per_token":
        return total / tokens if tokens else 0.0
    return sum(per_completion) / len(per_completion)


@pytest.mark.parametrize("seed", range(10))
@pytest.mark.parametrize("agg", [a.value for a in Aggregation])
def test_aggregate_matches_loop(seed, agg):
    rng = random.Random(seed)
    n, tt = rng.randint(1, 6), rng.randint(1, 9)
    loss = [[rng.uniform(-5, 5) for _ in range(tt)] for _ in range(n)]
    mask = [[float(rng.random() > 0.3) for _ in range(tt)] for _ in range(n)]
    got = aggregate(t(loss, torch.float64), t(mask, torch.float64), agg, constant_length=7)
    close(got, aggregate_loop(loss, mask, agg, 7), 1e-9)


# --- policy loss: DESIGN.md worked numbers ----------------------------------------------------------


def test_design_ratio_clip():
    # pi_old = 0.4, pi_theta = 0.6 -> ratio 1.5; eps = 0.2, A = 1: min(1.5 * 1, 1.2 * 1) = 1.2; loss = -1.2
    out = loss_of([[math.log(0.6) - math.log(0.4)]], [1.0])
    close(out.loss, -1.2)
    close(out.clip_fraction_high, 1.0)
    # log-ratio 0.5 -> ratio e^0.5 = 1.648721
    # A = +1: min(1.648721, 1.2) = 1.2 (clipped) -> loss -1.2, the high clip is active
    out = loss_of([[0.5]], [1.0])
    close(out.loss, -1.2)
    close((out.clip_fraction, out.clip_fraction_low, out.clip_fraction_high), (1.0, 0.0, 1.0))
    # A = -1: min(-1.648721, -1.2) = -1.648721 (not clipped) -> loss 1.6487, no clip counted
    out = loss_of([[0.5]], [-1.0])
    close(out.loss, 1.6487)
    close(out.clip_fraction, 0.0)


def test_clip_fractions_low_and_high():
    # eps = 0.2, eps_high = 0.28; ratios e^-0.5 = 0.61 (< 0.8), e^0 = 1, e^0.3 = 1.35 (> 1.28)
    # completion 0 (A = -1): token 0 is low-clipped; completion 1 (A = +1): token 2 is high-clipped
    # 6 tokens: low = 1/6, high = 1/6, total 2/6
    out = loss_of([[-0.5, 0.0, 0.3], [-0.5, 0.0, 0.3]], [-1.0, 1.0], epsilon_high=0.28)
    close((out.clip_fraction_low, out.clip_fraction_high, out.clip_fraction), (1 / 6, 1 / 6, 2 / 6))


def test_dual_clip_by_hand():
    # A = -1, ratio 5 (log 5), eps = 0.2, c = 3
    # min(5 * -1, 1.2 * -1) = -5; dual clip: max(-5, 3 * -1) = -3 -> loss 3 (without c: 5)
    close(loss_of([[math.log(5)]], [-1.0], clip_ratio_c=3.0).loss, 3.0)
    close(loss_of([[math.log(5)]], [-1.0]).loss, 5.0)
    # ratio 2 < c: min(-2, -1.2) = -2; max(-2, -3) = -2 -> loss 2 (dual clip inactive)
    close(loss_of([[math.log(2)]], [-1.0], clip_ratio_c=3.0).loss, 2.0)
    # A = +1 is untouched: min(5, 1.2) = 1.2 -> loss -1.2
    close(loss_of([[math.log(5)]], [1.0], clip_ratio_c=3.0).loss, -1.2)
    with pytest.raises(ValueError):
        loss_of([[0.0]], [1.0], clip_ratio_c=1.0)


def test_kl_term_by_hand():
    # ratio 1, A = 0.5 -> surrogate 0.5; log pi_theta = -1, log pi_ref = -1.5 -> k3 = 0.106531
    # beta = 0.1: loss = -(0.5 - 0.1 * 0.106531) = -0.489347; kl metric = 0.106531
    lp, ref, mask = t([[-1.0]]), t([[-1.5]]), t([[1.0]])
    common = dict(epsilon=0.2, epsilon_high=0.2, aggregation="per_token")
    out = loss_with(lp, lp, ref, t([0.5]), mask, beta=0.1, **common)
    close((out.loss, out.kl), (-0.489347, 0.106531))
    # k2 = 0.125: loss = -(0.5 - 0.0125) = -0.4875
    close(loss_with(lp, lp, ref, t([0.5]), mask, beta=0.1, kl_estimator="k2", **common).loss, -0.4875)
    # a tensor beta works the same; beta = 0 or no reference: KL term and metric are 0
    close(loss_with(lp, lp, ref, t([0.5]), mask, beta=t(0.1), **common).kl, 0.106531)
    close(loss_with(lp, lp, ref, t([0.5]), mask, beta=t(0.0), **common).kl, 0.0)
    for beta, r in [(0.0, ref), (0.1, None)]:
        out = loss_with(lp, lp, r, t([0.5]), mask, beta=beta, **common)
        close((out.loss, out.kl), (-0.5, 0.0))


def test_entropy_bonus_by_hand():
    # ratio 1, A = 1 -> surrogate 1 per token; entropies 2.0 and 1.0, coef 0.1
    # per token loss: -1 - 0.1 * 2 = -1.2, -1 - 0.1 * 1 = -1.1; per_token mean = -1.15; entropy metric 1.5
    lp = t([[-1.0, -2.0]])
    common = dict(epsilon=0.2, epsilon_high=0.2, beta=0.0, aggregation="per_token")
    out = loss_with(lp, lp, None, t([1.0]), t([[1, 1]]), entropy=t([[2.0, 1.0]]), entropy_coef=0.1, **common)
    close((out.loss, out.entropy), (-1.15, 1.5))
    # no coefficient: the metric is still reported, the loss is the plain -1
    out = loss_with(lp, lp, None, t([1.0]), t([[1, 1]]), entropy=t([[2.0, 1.0]]), **common)
    close((out.loss, out.entropy), (-1.0, 1.5))
    close(loss_with(lp, lp, None, t([1.0]), t([[1, 1]]), **common).entropy, 0.0)


def test_gspo_sequence_ratio_by_hand():
    # log-ratios 0.1, 0.3 -> mean 0.2 -> s = e^0.2 = 1.221403; A = 1, eps = 0.2
    # min(1.221403, 1.2) = 1.2 on both tokens -> loss -1.2
    close(loss_of([[0.1, 0.3]], [1.0], importance_level="sequence").loss, -1.2)
    # log-ratios 0.1, -0.1 -> mean 0 -> s = 1 -> loss -1
    close(loss_of([[0.1, -0.1]], [1.0], importance_level="sequence").loss, -1.0)
    # token level instead: ratios e^0.1 = 1.105171, e^-0.1 = 0.904837, neither clipped
    # loss = -(1.105171 + 0.904837)/2 = -1.005004
    close(loss_of([[0.1, -0.1]], [1.0]).loss, -1.005004)


def test_gspo_gradient_matches_sequence_ratio_broadcast():
    # GSPO's gradient is that of s_i = exp(mean_t log-ratio) broadcast to the tokens; our token form
    # sg[s] * exp(logp - sg[logp]) must give the same value and gradient under every aggregation.
    torch.manual_seed(0)
    old = torch.randn(4, 6, dtype=torch.float64)
    lp0 = old + 0.3 * torch.randn(4, 6, dtype=torch.float64)
    adv = torch.tensor([1.0, -0.5, 2.0, -1.5], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0], [1, 0, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0]])
    for agg in Aggregation:
        lp = lp0.clone().requires_grad_(True)
        out = loss_with(
            lp, old, None, adv, mask, epsilon=0.2, epsilon_high=0.3, beta=0.0, aggregation=agg,
            constant_length=6, importance_level="sequence",
        )  # fmt: skip
        out.loss.backward()
        ref_lp = lp0.clone().requires_grad_(True)
        seq = ((ref_lp - old) * mask).sum(-1) / mask.sum(-1)  # [N]
        s = torch.exp(seq).unsqueeze(-1).expand(4, 6)  # [N, T]
        a = adv.unsqueeze(-1)  # [N, 1]
        surrogate = torch.minimum(s * a, s.clamp(0.8, 1.3) * a)  # [N, T]
        ref_loss = aggregate(-surrogate, mask, agg, constant_length=6)
        ref_loss.backward()
        torch.testing.assert_close(out.loss, ref_loss)
        torch.testing.assert_close(lp.grad, ref_lp.grad)


def test_ratio_one_gradient_is_minus_advantage_grad_logp():
    # mu = 1: old = logprobs.detach() -> ratio 1, loss = -sum_t A_i m / sum m, d loss/d logp = -A_i / 4 tokens
    lp = t([[-1.0, -2.0, -0.5], [-0.3, -0.7, -9.0]]).requires_grad_(True)
    mask = t([[1, 1, 1], [1, 0, 0]])
    adv = t([2.0, -1.0])
    out = loss_with(
        lp, lp.detach(), None, adv, mask, epsilon=0.2, epsilon_high=0.2, beta=0.0, aggregation="per_token"
    )
    out.loss.backward()
    close(lp.grad, [[-0.5, -0.5, -0.5], [0.25, 0.0, 0.0]])
    close(out.clip_fraction, 0.0)


@pytest.mark.parametrize("agg", list(Aggregation))
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_masked_garbage_never_changes_loss_or_grad(agg, level):
    torch.manual_seed(1)
    old = -torch.rand(3, 5) * 3
    lp0 = old + 0.2 * torch.randn(3, 5)
    ref = old + 0.2 * torch.randn(3, 5)
    ent = torch.rand(3, 5)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0]], dtype=torch.bool)

    def run(lp_values, old_values, ref_values, ent_values):
        lp = lp_values.clone().requires_grad_(True)
        out = loss_with(
            lp, old_values, ref_values, torch.tensor([1.0, -2.0, 0.5]), mask, epsilon=0.2, epsilon_high=0.28,
            beta=0.05, aggregation=agg, constant_length=5, clip_ratio_c=3.0, importance_level=level,
            entropy=ent_values, entropy_coef=0.01,
        )  # fmt: skip
        out.loss.backward()
        return out, lp.grad

    def garbage(x, value):
        return torch.where(mask, x, torch.full_like(x, value))

    clean, clean_grad = run(lp0, old, ref, ent)
    for value in [1e4, -1e4, 3e38, float("nan")]:
        dirty, dirty_grad = run(
            garbage(lp0, value), garbage(old, -value), garbage(ref, value), garbage(ent, value)
        )
        for a, b in zip(clean, dirty):
            torch.testing.assert_close(a, b)
        torch.testing.assert_close(clean_grad, dirty_grad)
        assert torch.isfinite(dirty_grad).all()


# --- policy loss vs a plain loop --------------------------------------------------------------------


def policy_loss_loop(lp, old, ref, adv, mask, eps, eps_high, beta, c, agg, constant_length):
    per_token = []
    for i in range(len(lp)):
        row = []
        for j in range(len(lp[i])):
            ratio = math.exp(lp[i][j] - old[i][j])
            sur = min(ratio * adv[i], min(max(ratio, 1 - eps), 1 + eps_high) * adv[i])
            if c is not None and adv[i] < 0:
                sur = max(sur, c * adv[i])
            d = ref[i][j] - lp[i][j]
            row.append(-(sur - beta * (math.exp(d) - d - 1)))
        per_token.append(row)
    return aggregate_loop(per_token, mask, agg, constant_length)


@pytest.mark.parametrize("seed", range(10))
@pytest.mark.parametrize("agg", [a.value for a in Aggregation])
def test_policy_loss_matches_loop(seed, agg):
    rng = random.Random(seed)
    n, tt = rng.randint(1, 5), rng.randint(1, 7)
    old = [[-rng.uniform(0.1, 4) for _ in range(tt)] for _ in range(n)]
    lp = [[o + rng.uniform(-0.6, 0.6) for o in row] for row in old]
    ref = [[o + rng.uniform(-0.6, 0.6) for o in row] for row in old]
    adv = [rng.uniform(-2, 2) for _ in range(n)]
    mask = [[float(rng.random() > 0.3) for _ in range(tt)] for _ in range(n)]
    c = 3.0 if seed % 2 else None
    got = loss_with(
        t(lp, torch.float64), t(old, torch.float64), t(ref, torch.float64), t(adv, torch.float64),
        t(mask, torch.float64), epsilon=0.2, epsilon_high=0.28, beta=0.04, aggregation=agg,
        constant_length=7, clip_ratio_c=c,
    )  # fmt: skip
    close(got.loss, policy_loss_loop(lp, old, ref, adv, mask, 0.2, 0.28, 0.04, c, agg, 7), 1e-9)


# --- micro-batches with the step normalizer ---------------------------------------------------------


@pytest.mark.parametrize("agg", list(Aggregation))
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_micro_batches_sum_to_whole_step(agg, level):
    torch.manual_seed(2)
    n, tt = 6, 7
    old = -torch.rand(n, tt, dtype=torch.float64) * 3
    lp0 = old + 0.3 * torch.randn(n, tt, dtype=torch.float64)
    ref = old + 0.3 * torch.randn(n, tt, dtype=torch.float64)
    adv = torch.randn(n, dtype=torch.float64)
    lengths = torch.tensor([7, 3, 1, 5, 0, 6])
    mask = torch.arange(tt) < lengths.unsqueeze(-1)  # [N, T]
    kw = dict(
        epsilon=0.2, epsilon_high=0.28, beta=0.04, aggregation=agg, constant_length=7, importance_level=level
    )

    whole_lp = lp0.clone().requires_grad_(True)
    whole = loss_with(whole_lp, old, ref, adv, mask, **kw).loss
    whole.backward()

    # per_token: the step's token count; per_response / constant_length: the step's completion count
    normalizer = mask.sum() if Aggregation(agg) is Aggregation.PER_TOKEN else n
    split_lp = lp0.clone().requires_grad_(True)
    total = 0.0
    for rows in [slice(0, 2), slice(2, 5), slice(5, 6)]:  # micro-batch sizes 2, 3, 1
        part = loss_with(
            split_lp[rows], old[rows], ref[rows], adv[rows], mask[rows], normalizer=normalizer, **kw
        )
        part.loss.backward()
        total = total + part.loss.detach()
    torch.testing.assert_close(total, whole.detach())
    torch.testing.assert_close(split_lp.grad, whole_lp.grad)


# --- adaptive KL controller ---------------------------------------------------------------------------


def test_adaptive_beta_grows_and_shrinks():
    # beta = 0.1, target = 6, horizon = 10000, n_steps = 256 -> n_steps/horizon = 0.0256
    kw = dict(target=6.0, horizon=10000, n_steps=256)
    # KL 12: error = 12/6 - 1 = 1 -> clipped to 0.2 -> 0.1 * (1 + 0.2 * 0.0256) = 0.1 * 1.00512 = 0.100512
    assert adaptive_beta(0.1, 12.0, **kw) == pytest.approx(0.100512)
    # KL 6.6: error = 0.1 -> 0.1 * (1 + 0.00256) = 0.100256
    assert adaptive_beta(0.1, 6.6, **kw) == pytest.approx(0.100256)
    # KL 3: error = -0.5 -> clipped to -0.2 -> 0.1 * (1 - 0.00512) = 0.099488
    assert adaptive_beta(0.1, 3.0, **kw) == pytest.approx(0.099488)
    # at the target: unchanged
    assert adaptive_beta(0.1, 6.0, **kw) == pytest.approx(0.1)
    # tensors in -> tensor out
    got = adaptive_beta(t(0.1), t(12.0), **kw)
    assert isinstance(got, torch.Tensor)
    close(got, 0.100512)
    assert isinstance(adaptive_beta(0.1, 3.0, **kw), float)
