"""The policy-loss table (clip, cispo, sapo, dppo_tv, dppo_kl) and the knobs that compose with it:
worked numbers, the peers' own formulas (value and gradient), and plain loops.

The peers' formulas are written here from reading their code (TRL f2cd577 `trl/trainer/grpo_trainer.py`,
`GRPOTrainer._compute_loss`; verl `verl/trainer/ppo/core_algos.py`, the `compute_policy_loss_*`
functions of its registry and `agg_loss`): each reference is our own transcription of the peer's
arithmetic, as the peer writes it, not the peer's code.
"""

import math
import random

import pytest
import torch

from grpo_run.algo import (
    POLICY_LOSSES,
    Aggregation,
    LossInputs,
    LossSettings,
    PolicyLoss,
    aggregate,
    applied_entropy_coef,
    binary_kl,
    high_entropy_mask,
    next_entropy_coef,
    off_policy_sequence_mask,
    policy_loss,
)
from tests.algo.loss_call import loss_with

LN = math.log


def t(x, dtype=torch.float64):
    return torch.tensor(x, dtype=dtype)


def close(got, expected, tol=1e-5):
    torch.testing.assert_close(got, torch.as_tensor(expected, dtype=got.dtype), atol=tol, rtol=0)


def one_token(log_ratio, advantage, old=-1.0, **kw):
    """Loss and d loss / d log pi_theta of one completion of one token (per_token aggregation)."""
    lp = t([[old + log_ratio]]).requires_grad_(True)
    kw.setdefault("aggregation", "per_token")
    kw.setdefault("beta", 0.0)
    out = loss_with(lp, t([[old]]), None, t([advantage]), t([[1.0]]), **kw)
    out.loss.backward()
    return out, lp.grad.item()


# --- worked numbers -----------------------------------------------------------------------------------


def test_two_sided_clip_by_hand():
    # r = e^1 = 2.718282, A = -1, eps 0.2, delta 2: unclipped branch min(r, 2) A = -2; clipped 1.2 A = -1.2
    # min(-2, -1.2) = -2 -> loss 2, and the ratio is capped: gradient 0
    out, grad = one_token(1.0, -1.0, delta=2.0)
    close(out.loss, 2.0)
    assert grad == 0.0
    # without delta: min(-2.718282, -1.2) -> loss 2.718282, gradient -A r = 2.718282
    out, grad = one_token(1.0, -1.0)
    close(out.loss, math.e)
    assert grad == pytest.approx(math.e)
    # r = 1.5 < delta: nothing changes, -(min(1.5 * -1, 1.2 * -1)) = 1.5
    close(one_token(LN(1.5), -1.0, delta=2.0)[0].loss, 1.5)
    # A > 0: the clipped branch already binds above 1 + eps_high < delta: min(2 * 1, 1.2) = 1.2
    close(one_token(1.0, 1.0, delta=2.0)[0].loss, -1.2)


@pytest.mark.parametrize("seed", range(5))
def test_two_sided_clip_equals_dual_clip_at_c_delta(seed):
    # For A < 0 and r > delta both give delta A with zero gradient; elsewhere both are the plain clip.
    torch.manual_seed(seed)
    old = -torch.rand(4, 6, dtype=torch.float64) * 3
    lp0 = old + torch.randn(4, 6, dtype=torch.float64)
    adv = torch.randn(4, dtype=torch.float64)
    mask = torch.rand(4, 6) > 0.2
    grads = []
    for kw in (dict(delta=2.5), dict(clip_ratio_c=2.5)):
        lp = lp0.clone().requires_grad_(True)
        out = loss_with(
            lp, old, None, adv, mask, beta=0.0, aggregation="per_response", epsilon_high=0.28, **kw
        )
        out.loss.backward()
        grads.append((out.loss.detach(), lp.grad))
    torch.testing.assert_close(grads[0], grads[1])


def test_cispo_by_hand():
    # absolute (TRL): r = 6, cap 5 -> weight 5; A = 1, log pi = -1 + ln 6 = 0.791759
    # surrogate 5 * 1 * 0.791759 -> loss -3.958797; d loss / d log pi = -5 A = -5
    out, grad = one_token(LN(6), 1.0, policy_loss="cispo", cispo_cap=5.0)
    close(out.loss, -5 * (-1 + LN(6)))
    assert grad == pytest.approx(-5.0)
    close(out.clip_fraction_high, 1.0)
    # r = 2 under the cap: weight 2, gradient -2 A = -2
    assert one_token(LN(2), 1.0, policy_loss="cispo", cispo_cap=5.0)[1] == pytest.approx(-2.0)
    # relative (verl): r = 0.5, eps 0.2 -> weight raised to 0.8; A = -1, log pi = -2 + ln 0.5 = -2.693147
    # surrogate 0.8 * -1 * -2.693147 = 2.154518 -> loss -2.154518; gradient -(0.8 * -1) = 0.8
    out, grad = one_token(LN(0.5), -1.0, old=-2.0, policy_loss="cispo", cispo_bounds="relative")
    close(out.loss, 0.8 * (-2 + LN(0.5)))
    assert grad == pytest.approx(0.8)
    close(out.clip_fraction_low, 1.0)
    # absolute never raises a small ratio: weight 0.5, gradient 0.5
    assert one_token(LN(0.5), -1.0, policy_loss="cispo")[1] == pytest.approx(0.5)


def test_sapo_by_hand():
    # r = 1, A = 1, tau_pos 1: gate sigmoid(0) * 4 / 1 = 2 -> loss -2
    # d gate / d r = tau s (1 - s) 4 / tau = 4 * 0.25 = 1, d r / d log pi = r = 1 -> gradient -A = -1
    out, grad = one_token(0.0, 1.0, policy_loss="sapo")
    close(out.loss, -2.0)
    assert grad == pytest.approx(-1.0)
    # A = -1, tau_neg 1.05: gate 0.5 * 4 / 1.05 = 1.904762 -> loss 1.904762; gradient -(A * 1 * 1) = 1
    out, grad = one_token(0.0, -1.0, policy_loss="sapo")
    close(out.loss, 2 / 1.05)
    assert grad == pytest.approx(1.0)
    # r = e^0.5 = 1.648721, A = 1: gate = 4 sigmoid(0.648721) = 4 * 0.656722 = 2.626889 -> loss -2.626889;
    # the gradient fades: -4 s (1 - s) r = -4 * 0.225438 * 1.648721 = -1.486739 (clip would give 0)
    out, grad = one_token(0.5, 1.0, policy_loss="sapo")
    close(out.loss, -2.626889)
    assert grad == pytest.approx(-1.486739, abs=1e-5)
    assert out.clip_fraction.item() == 0.0


def test_dppo_tv_by_hand():
    # p_old = 0.5; A = 1, p = 0.6: p - p_old = 0.1 <= 0.2 -> kept; r = 1.2 (detached)
    # surrogate 1.2 * 1 * ln 0.6 = -0.612991 -> loss 0.612991; gradient -r A = -1.2
    out, grad = one_token(LN(1.2), 1.0, old=LN(0.5), policy_loss="dppo_tv")
    close(out.loss, -1.2 * LN(0.6))
    assert grad == pytest.approx(-1.2)
    assert out.trust_region_masked_fraction.item() == 0.0
    # p = 0.8: p - p_old = 0.3 > 0.2 -> masked: loss 0, gradient 0
    out, grad = one_token(LN(1.6), 1.0, old=LN(0.5), policy_loss="dppo_tv")
    assert (out.loss.item(), grad) == (0.0, 0.0)
    close(out.clip_fraction_high, 1.0)
    close(out.trust_region_masked_fraction, 1.0)
    # A = -1, p = 0.2: p - p_old = -0.3 < -0.2 -> masked; p = 0.8 with A = -1 is inside (only falls count)
    assert one_token(LN(0.4), -1.0, old=LN(0.5), policy_loss="dppo_tv")[1] == 0.0
    assert one_token(LN(1.6), -1.0, old=LN(0.5), policy_loss="dppo_tv")[1] == pytest.approx(1.6)
    # clip_ratio_c caps the detached weight: r = 1.6 -> 1.5, gradient -(1.5 * -1) = 1.5
    got = one_token(LN(1.6), -1.0, old=LN(0.5), policy_loss="dppo_tv", clip_ratio_c=1.5)[1]
    assert got == pytest.approx(1.5)


def test_dppo_kl_by_hand():
    # binary KL(0.5 || 0.8) = 0.5 ln(0.5/0.8) + 0.5 ln(0.5/0.2) = -0.235002 + 0.458145 = 0.223144
    close(binary_kl(t([[LN(0.5)]]), t([[LN(0.8)]])), [[0.223144]])
    # A = 1, p rose to 0.8: KL 0.223144 > 0.2 -> masked
    assert one_token(LN(1.6), 1.0, old=LN(0.5), policy_loss="dppo_kl")[1] == 0.0
    # ... unless the bound is 0.25; or p = 0.6: KL = 0.5 ln(5/6) + 0.5 ln(5/4) = 0.020411 -> kept, grad -1.2
    assert one_token(LN(1.6), 1.0, old=LN(0.5), policy_loss="dppo_kl", trust_region_high=0.25)[
        1
    ] == pytest.approx(-1.6)
    assert one_token(LN(1.2), 1.0, old=LN(0.5), policy_loss="dppo_kl")[1] == pytest.approx(-1.2)
    # A = -1 and p rose: kept whatever the KL (it moved against A's push only if p fell)
    assert one_token(LN(1.6), -1.0, old=LN(0.5), policy_loss="dppo_kl")[1] == pytest.approx(1.6)


def test_top_entropy_quantile_by_hand():
    # entropies [1, 2, 3, 4], rho = 0.5: the 0.5 quantile is 2.5 -> tokens 3 and 4 kept (share 0.5)
    # ratio 1, A = 1: surrogate 1 on kept tokens; per_token over all 4 loss tokens: -(1 + 1) / 4 = -0.5
    lp = t([[-1.0, -1.0, -1.0, -1.0]])
    ent = t([[1.0, 2.0, 3.0, 4.0]])
    mask = torch.ones(1, 4)
    kw = dict(aggregation="per_token", beta=0.0, top_entropy_quantile=0.5)
    out = loss_with(lp, lp, None, t([1.0]), mask, entropy=ent, **kw)
    close(out.loss, -0.5)
    close(out.entropy_kept_fraction, 0.5)
    # the entropy bonus acts on the kept tokens too (TRL): -(2 + 0.1 * (3 + 4)) / 4 = -0.675
    close(loss_with(lp, lp, None, t([1.0]), mask, entropy=ent, entropy_coef=0.1, **kw).loss, -0.675)
    # rho = 1 keeps every token and needs no entropy; an empty mask keeps none
    assert high_entropy_mask(ent, torch.zeros(1, 4), 0.5).sum() == 0
    with pytest.raises(ValueError, match="entropy"):
        loss_with(lp, lp, None, t([1.0]), mask, **kw)


def test_off_policy_mask_by_hand():
    # two one-token completions, log pi_theta - log pi_behaviour = -0.5 on both -> sequence KL 0.5
    # threshold 0.4: the A = -1 completion is dropped, the A = +1 one kept (share masked 0.5)
    # kept: ratio e^-0.5 = 0.606531, min(0.606531, clip -> 0.8) = 0.606531; per_token: -0.606531 / 2
    old = t([[-1.0], [-1.0]])
    lp = old - 0.5
    kw = dict(aggregation="per_token", beta=0.0, off_policy_mask_threshold=0.4)
    out = loss_with(lp, old, None, t([1.0, -1.0]), torch.ones(2, 1), **kw)
    close(out.loss, -math.exp(-0.5) / 2)
    close(out.off_policy_masked_fraction, 0.5)
    # the sampler's log-probs, when given, are the behaviour policy: equal to pi_theta -> KL 0, both kept
    out = loss_with(lp, old, None, t([1.0, -1.0]), torch.ones(2, 1), behaviour_logprobs=lp, **kw)
    close(out.off_policy_masked_fraction, 0.0)
    # the sequence KL is a token mean: [-0.2, -0.8] -> 0.5 > 0.4
    seq = off_policy_sequence_mask(t([-1.0]), t([[-1.2, -1.8]]), t([[-1.0, -1.0]]), torch.ones(1, 2), 0.4)
    assert seq.tolist() == [False]


def test_kl_bias_correction_by_hand():
    # log pi = -1, log pi_old = -1.5 -> ratio e^0.5 = 1.648721; log pi_ref = -1.5 -> k3 = e^-0.5 + 0.5 - 1
    # = 0.106531; corrected 0.106531 * 1.648721 = 0.175639; A = 0, beta 0.1 -> loss 0.0175639
    kw = dict(aggregation="per_token", beta=0.1)
    lp, old, ref = t([[-1.0]]), t([[-1.5]]), t([[-1.5]])
    close(loss_with(lp, old, ref, t([0.0]), torch.ones(1, 1), kl_bias_correction=True, **kw).loss, 0.0175639)
    close(loss_with(lp, old, ref, t([0.0]), torch.ones(1, 1), **kw).loss, 0.0106531)


def test_settings_refuse_nonsense():
    with pytest.raises(ValueError, match="clip_ratio_c"):
        LossSettings(clip_ratio_c=1.0)
    with pytest.raises(ValueError, match="top_entropy_quantile"):
        LossSettings(top_entropy_quantile=0.0)
    assert LossSettings(policy_loss="sapo").policy_loss is PolicyLoss.SAPO


# --- the peers' formulas, value and gradient -----------------------------------------------------------


def random_batch(seed, n=5, tt=7, spread=0.6):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(n, tt, generator=g, dtype=torch.float64) * 2 - 0.05  # log p_old in (-2.05, -0.05)
    lp0 = (old + spread * torch.randn(n, tt, generator=g, dtype=torch.float64)).clamp(max=-1e-3)
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    lengths = torch.randint(1, tt + 1, (n,), generator=g)
    mask = (torch.arange(tt) < lengths.unsqueeze(-1)).to(torch.float64)  # [N, T], no empty row
    ent = torch.rand(n, tt, generator=g, dtype=torch.float64) * 3
    return old, lp0, adv, mask, ent


def ours(lp0, old, adv, mask, *, ref=None, **kw):
    lp = lp0.clone().requires_grad_(True)
    kw.setdefault("beta", 0.0)
    out = loss_with(lp, old, ref, adv, mask, **kw)
    out.loss.backward()
    return out.loss.detach(), lp.grad


def reference(fn, lp0, *args):
    lp = lp0.clone().requires_grad_(True)
    loss = fn(lp, *args)
    loss.backward()
    return loss.detach(), lp.grad


def trl_token_sum(per_token_loss, mask):
    """TRL's loss for cispo/dapo: (per_token_loss * mask).sum() / num_items_in_batch (one process)."""
    return (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)


def trl_seq_mean(per_token_loss, mask):
    """TRL's loss for grpo/sapo: ((l * mask).sum(-1) / mask.sum(-1).clamp(min=1)).mean()."""
    return ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()


def verl_agg(loss_mat, mask, mode):
    """verl's agg_loss, token-mean and seq-mean-token-mean (dp_size 1, the micro-batch's own counts)."""
    if mode == "token-mean":
        return (loss_mat * mask).sum() / mask.sum()
    seq_tokens = mask.sum(-1)
    seq_losses = (loss_mat * mask).sum(-1) / (seq_tokens + 1e-8)
    seq_mask = (seq_tokens > 0).to(loss_mat.dtype)
    return (seq_losses * seq_mask).sum() / seq_mask.sum()


@pytest.mark.parametrize("seed", range(4))
def test_cispo_absolute_equals_trl(seed):
    """TRL `grpo_trainer.py` `_compute_loss`, loss_type="cispo": clamp(coef_1, max=epsilon_high).detach()
    * A * log p, summed over tokens / num_items_in_batch. TRL's epsilon_high is our grpo.cispo_cap."""
    old, lp0, adv, mask, _ = random_batch(seed, spread=1.5)
    cap = 1.5

    def trl(lp, old, adv, mask):
        coef_1 = torch.exp(lp - old)
        clamped = torch.clamp(coef_1, max=cap).detach()
        return trl_token_sum(-clamped * adv.unsqueeze(1) * lp, mask)

    got = ours(lp0, old, adv, mask, policy_loss="cispo", cispo_cap=cap, aggregation="per_token")
    torch.testing.assert_close(got, reference(trl, lp0, old, adv, mask))


@pytest.mark.parametrize("seed", range(4))
def test_cispo_relative_equals_verl(seed):
    """verl `core_algos.py` `compute_policy_loss_cispo`: clamp(ratio, 1 - clip_ratio_low,
    1 + clip_ratio_high).detach() * A * log_prob, agg_loss token-mean."""
    old, lp0, adv, mask, _ = random_batch(seed, spread=1.0)
    low, high = 0.2, 0.28

    def verl(lp, old, adv, mask):
        ratio = torch.exp(torch.clamp(lp - old, min=-20.0, max=20.0))
        clipped_sg = torch.clamp(ratio, 1 - low, 1 + high).detach()
        return verl_agg(-clipped_sg * adv.unsqueeze(1) * lp, mask, "token-mean")

    kw = dict(
        policy_loss="cispo", cispo_bounds="relative", epsilon=low, epsilon_high=high, aggregation="per_token"
    )
    torch.testing.assert_close(ours(lp0, old, adv, mask, **kw), reference(verl, lp0, old, adv, mask))


def test_cispo_bounds_agree_only_at_verl_low_one():
    """The peers agree when verl's clip_ratio_low is 1 (no lower bound) and TRL's cap is 1 + high."""
    old, lp0, adv, mask, _ = random_batch(7, spread=1.2)
    a = ours(lp0, old, adv, mask, policy_loss="cispo", cispo_cap=1.28, aggregation="per_token")
    kw = dict(policy_loss="cispo", cispo_bounds="relative", epsilon=1.0, epsilon_high=0.28)
    b = ours(lp0, old, adv, mask, aggregation="per_token", **kw)
    torch.testing.assert_close(a, b)
    c = ours(lp0, old, adv, mask, aggregation="per_token", **{**kw, "epsilon": 0.2})
    assert not torch.allclose(a[1], c[1])


def sapo_gate(ratio, adv, tau_pos, tau_neg):
    taus = torch.where(adv.unsqueeze(1) > 0, tau_pos, tau_neg)
    return torch.sigmoid(taus * (ratio - 1.0)) * (4.0 / taus)


@pytest.mark.parametrize("seed", range(4))
def test_sapo_equals_trl_and_verl(seed):
    """TRL `_compute_loss`, loss_type="sapo": sigmoid(tau (coef_1 - 1)) * 4 / tau * A, tau by A > 0,
    per-sequence token mean then mean over every sequence. verl `compute_policy_loss_sapo`: the same gate,
    agg_loss seq-mean-token-mean (length + 1e-8, non-empty sequences only). Ours: per_response."""
    old, lp0, adv, mask, _ = random_batch(seed, spread=1.0)

    def trl(lp, old, adv, mask):
        coef_1 = torch.exp(lp - old)
        return trl_seq_mean(-sapo_gate(coef_1, adv, 1.0, 1.05) * adv.unsqueeze(1), mask)

    def verl(lp, old, adv, mask):
        ratio = torch.exp(torch.clamp(lp - old, min=-20.0, max=20.0))
        return verl_agg(-sapo_gate(ratio, adv, 1.0, 1.05) * adv.unsqueeze(1), mask, "seq-mean-token-mean")

    got = ours(lp0, old, adv, mask, policy_loss="sapo", aggregation="per_response")
    torch.testing.assert_close(got, reference(trl, lp0, old, adv, mask))
    torch.testing.assert_close(got, reference(verl, lp0, old, adv, mask))


def test_sapo_empty_completion_counts_as_verl():
    """A completion with no loss token (mask_truncated): our step normaliser counts the completions still
    in the loss, as verl's seq-mean-token-mean does; TRL's .mean() would count it too."""
    old, lp0, adv, mask, _ = random_batch(3)
    mask[1] = 0.0

    def verl(lp, old, adv, mask):
        ratio = torch.exp(lp - old)
        return verl_agg(-sapo_gate(ratio, adv, 1.0, 1.05) * adv.unsqueeze(1), mask, "seq-mean-token-mean")

    kept = (mask.sum(-1) > 0).sum()
    got = ours(lp0, old, adv, mask, policy_loss="sapo", aggregation="per_response", normalizer=kept)
    torch.testing.assert_close(got, reference(verl, lp0, old, adv, mask))


def verl_dppo(kind, low, high, c):
    """verl `compute_policy_loss_dppo_tv` / `compute_policy_loss_dppo_kl`: -A * sg(min(ratio, c)) * log_prob
    * valid_mask, agg_loss token-mean; the masks as the peer writes them."""

    def loss(lp, old, adv, mask):
        a = adv.unsqueeze(1)
        ratio = torch.exp(torch.clamp(lp - old, min=-20.0, max=20.0))
        truncated = torch.clamp(ratio, max=c).detach()
        prob, old_prob = torch.exp(lp), torch.exp(old)
        if kind == "tv":
            pos = (prob - old_prob) <= high
            neg = (prob - old_prob) >= -low
        else:
            bkl = old_prob * (old - lp) + (1 - old_prob) * torch.log(
                (1.0 - old_prob + 1e-8) / (1.0 - prob + 1e-8)
            )
            pos = (bkl <= high) | (prob <= old_prob)
            neg = (bkl <= low) | (prob >= old_prob)
        valid = torch.where(a > 0, pos, neg).detach().to(lp.dtype)
        return verl_agg(-a * truncated * lp * valid, mask, "token-mean")

    return loss


@pytest.mark.parametrize("kind", ["tv", "kl"])
@pytest.mark.parametrize("seed", range(4))
def test_dppo_equals_verl(kind, seed):
    old, lp0, adv, mask, _ = random_batch(seed, spread=0.8)
    kw = dict(policy_loss=f"dppo_{kind}", trust_region_low=0.1, trust_region_high=0.15, clip_ratio_c=3.0)
    got = ours(lp0, old, adv, mask, aggregation="per_token", **kw)
    torch.testing.assert_close(got, reference(verl_dppo(kind, 0.1, 0.15, 3.0), lp0, old, adv, mask))
    masked = loss_with(
        lp0, old, None, adv, mask, beta=0.0, aggregation="per_token", **kw
    ).trust_region_masked_fraction
    assert 0 < masked.item() < 1  # both kinds of token occur


@pytest.mark.parametrize("kind", ["tv", "kl"])
def test_dppo_gradient_equals_the_ratio_form(kind):
    """prime-rl (as the issue reads it) writes DPPO's surrogate as r A on the same tokens: its value differs
    from verl's sg(r) A log p, its gradient is the same while no cap binds (clip_ratio_c null)."""
    old, lp0, adv, mask, _ = random_batch(11, spread=0.8)
    got = ours(lp0, old, adv, mask, aggregation="per_token", policy_loss=f"dppo_{kind}")

    def ratio_form(lp, old, adv, mask):
        keep = (verl_dppo_valid(kind, lp.detach(), old, adv)).to(lp.dtype)
        return -(torch.exp(lp - old) * adv.unsqueeze(1) * keep * mask).sum() / mask.sum()

    want = reference(ratio_form, lp0, old, adv, mask)
    torch.testing.assert_close(got[1], want[1])
    assert not torch.allclose(got[0], want[0])


def verl_dppo_valid(kind, lp, old, adv):
    change = torch.exp(lp) - torch.exp(old)
    if kind == "tv":
        return torch.where(adv.unsqueeze(1) > 0, change <= 0.2, change >= -0.2)
    bkl = binary_kl(old, lp)
    return torch.where(adv.unsqueeze(1) > 0, (bkl <= 0.2) | (change <= 0), (bkl <= 0.2) | (change >= 0))


@pytest.mark.parametrize("seed", range(4))
def test_two_sided_clip_equals_trl(seed):
    """TRL `_compute_loss`, loss_type="grpo" with args.delta: coef_2 = clamp(coef_1, 1 - eps, 1 + eps_high),
    then coef_1 = clamp(coef_1, max=delta); -min(coef_1 A, coef_2 A), per-sequence mean."""
    old, lp0, adv, mask, _ = random_batch(seed, spread=1.2)

    def trl(lp, old, adv, mask):
        coef_1 = torch.exp(lp - old)
        coef_2 = torch.clamp(coef_1, 1 - 0.2, 1 + 0.28)
        coef_1 = torch.clamp(coef_1, max=1.5)
        a = adv.unsqueeze(1)
        return trl_seq_mean(-torch.min(coef_1 * a, coef_2 * a), mask)

    got = ours(lp0, old, adv, mask, delta=1.5, epsilon_high=0.28, aggregation="per_response")
    torch.testing.assert_close(got, reference(trl, lp0, old, adv, mask))


@pytest.mark.parametrize("loss", ["clip", "cispo"])
def test_top_entropy_quantile_and_bonus_equal_trl(loss):
    """TRL `get_high_entropy_mask` (torch.quantile of the loss tokens' entropies at 1 - rho, kept where
    entropy >= it) multiplies the policy term; the entropy bonus (loss types cispo/dapo) is
    (entropies * mask * entropy_mask).sum() / num_items_in_batch. Ours: per_token with the same masks."""
    old, lp0, adv, mask, ent = random_batch(5, spread=0.5)
    rho, coef = 0.3, 0.05

    def trl(lp, old, adv, mask):
        local = ent[mask.bool()]
        threshold = torch.quantile(local, 1 - rho)
        entropy_mask = ((ent * mask) >= threshold) & mask.bool()
        a = adv.unsqueeze(1)
        coef_1 = torch.exp(lp - old)
        if loss == "cispo":
            per_token = -torch.clamp(coef_1, max=5.0).detach() * a * lp
        else:
            coef_2 = torch.clamp(coef_1, 0.8, 1.2)
            per_token = -torch.min(coef_1 * a, coef_2 * a)
        per_token = per_token * entropy_mask
        normalizer = mask.sum()
        policy = (per_token * mask).sum() / normalizer
        return policy - coef * (ent * (mask * entropy_mask)).sum() / normalizer

    kw = dict(
        policy_loss=loss, aggregation="per_token", top_entropy_quantile=rho, entropy=ent, entropy_coef=coef
    )
    torch.testing.assert_close(ours(lp0, old, adv, mask, **kw), reference(trl, lp0, old, adv, mask))


def test_off_policy_mask_and_bias_corrected_kl_equal_trl():
    """TRL `get_off_policy_mask` (keep if A >= 0 or the sequence's mean of sampling_logps - logps.detach()
    <= threshold) multiplies the policy term; `use_bias_correction_kl` multiplies the k3 KL by coef_1,
    undetached; loss = policy + beta kl, per-sequence mean (loss_type grpo)."""
    old, lp0, adv, mask, _ = random_batch(9, spread=0.5)
    adv[1] = -adv[1]  # its sequence KL to the sampler is 0.30 > threshold: dropped
    g = torch.Generator().manual_seed(1)
    sampler = old + 0.3 * torch.randn(old.shape, generator=g, dtype=torch.float64)
    ref = old + 0.3 * torch.randn(old.shape, generator=g, dtype=torch.float64)
    beta, threshold = 0.04, 0.05

    def trl(lp, old, adv, mask):
        a = adv.unsqueeze(1)
        kl_div = sampler - lp.detach()
        avg_seq_kl = (kl_div * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1.0)
        off_policy_mask = ((a >= 0) | (avg_seq_kl <= threshold)).to(mask.dtype)
        coef_1 = torch.exp(lp - old)
        per_token_kl = torch.exp(ref - lp) - (ref - lp) - 1
        per_token_kl = per_token_kl * coef_1
        coef_2 = torch.clamp(coef_1, 0.8, 1.2)
        per_token = -torch.min(coef_1 * a, coef_2 * a) * off_policy_mask
        return trl_seq_mean(per_token + beta * per_token_kl, mask)

    got = ours(
        lp0, old, adv, mask, ref=ref, beta=beta, aggregation="per_response", off_policy_mask_threshold=threshold,
        kl_bias_correction=True, behaviour_logprobs=sampler,
    )  # fmt: skip
    torch.testing.assert_close(got, reference(trl, lp0, old, adv, mask))
    dropped = loss_with(
        lp0, old, None, adv, mask, beta=0.0, off_policy_mask_threshold=threshold, behaviour_logprobs=sampler
    ).off_policy_masked_fraction
    assert 0 < dropped.item() < 1


# --- plain loops ---------------------------------------------------------------------------------------


def surrogate_loop(name, r, lp, old, a, s):
    """One token's surrogate value, written out per policy loss."""
    if name == "clip":
        capped = r if s.delta is None else min(r, s.delta)
        return min(capped * a, min(max(r, 1 - s.epsilon), 1 + s.epsilon_high) * a)
    if name == "cispo":
        return min(r, s.cispo_cap) * a * lp
    if name == "sapo":
        tau = s.sapo_tau_pos if a > 0 else s.sapo_tau_neg
        return 4 / tau / (1 + math.exp(-tau * (r - 1))) * a
    p, p_old = math.exp(lp), math.exp(old)
    if name == "dppo_tv":
        inside = p - p_old <= s.trust_region_high if a > 0 else p - p_old >= -s.trust_region_low
    else:
        kl = p_old * (old - lp) + (1 - p_old) * math.log((1 - p_old + 1e-8) / (1 - p + 1e-8))
        inside = (
            (kl <= s.trust_region_high or p <= p_old) if a > 0 else (kl <= s.trust_region_low or p >= p_old)
        )
    return r * a * lp if inside else 0.0


def quantile_loop(values, q):
    """Linear-interpolation quantile of a list, as torch.quantile defines it."""
    xs = sorted(values)
    pos = q * (len(xs) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("name", [p.value for p in PolicyLoss])
def test_policy_losses_match_loop(name, seed):
    rng = random.Random(seed)
    n, tt = rng.randint(1, 5), rng.randint(1, 7)
    old = [[-rng.uniform(0.05, 3) for _ in range(tt)] for _ in range(n)]
    lp = [[min(o + rng.uniform(-0.7, 0.7), -1e-3) for o in row] for row in old]
    ent = [[rng.uniform(0, 3) for _ in range(tt)] for _ in range(n)]
    adv = [rng.uniform(-2, 2) for _ in range(n)]
    mask = [[float(rng.random() > 0.3) for _ in range(tt)] for _ in range(n)]
    rho = 0.5 if seed % 2 else 1.0
    threshold = 0.1 if seed % 3 == 0 else None
    s = LossSettings(
        policy_loss=name, epsilon_high=0.28, delta=2.0 if seed % 2 else None, trust_region_low=0.1,
        trust_region_high=0.15, aggregation="per_token", top_entropy_quantile=rho,
        off_policy_mask_threshold=threshold,
    )  # fmt: skip
    kept_entropies = [ent[i][j] for i in range(n) for j in range(tt) if mask[i][j]]
    cut = quantile_loop(kept_entropies, 1 - rho) if kept_entropies else math.inf
    total, tokens = 0.0, 0.0
    for i in range(n):
        row_tokens = [j for j in range(tt) if mask[i][j]]
        kl = sum(old[i][j] - lp[i][j] for j in row_tokens) / max(len(row_tokens), 1)
        drop_row = threshold is not None and adv[i] < 0 and kl > threshold
        for j in row_tokens:
            tokens += 1
            if drop_row or (rho < 1 and ent[i][j] < cut):
                continue
            r = math.exp(lp[i][j] - old[i][j])
            total += -surrogate_loop(name, r, lp[i][j], old[i][j], adv[i], s)
    expected = total / tokens if tokens else 0.0
    got = policy_loss(LossInputs(t(lp), t(old), t(adv), t(mask), entropy=t(ent)), s, beta=0.0)
    close(got.loss, expected, 1e-9)


def test_the_table_names_every_policy_loss():
    assert set(POLICY_LOSSES) == set(PolicyLoss)


@pytest.mark.parametrize("name", [p.value for p in PolicyLoss])
@pytest.mark.parametrize("agg", list(Aggregation))
def test_micro_batches_sum_to_the_whole_step(name, agg):
    # Every surrogate is per token, so the step normaliser makes split micro-batches sum to the step.
    old, lp0, adv, mask, ent = random_batch(4, n=6)
    kw = dict(policy_loss=name, aggregation=agg, constant_length=7, beta=0.0)
    whole = ours(lp0, old, adv, mask, **kw)
    normalizer = mask.sum() if agg is Aggregation.PER_TOKEN else 6
    lp = lp0.clone().requires_grad_(True)
    total = 0.0
    for rows in (slice(0, 2), slice(2, 5), slice(5, 6)):
        part = loss_with(lp[rows], old[rows], None, adv[rows], mask[rows], normalizer=normalizer, **kw)
        part.loss.backward()
        total = total + part.loss.detach()
    torch.testing.assert_close((total, lp.grad), whole)


@pytest.mark.parametrize("name", ["clip", "cispo", "sapo"])
def test_sequence_level_ratio_composes(name):
    # GSPO's sequence ratio is shared by a completion's tokens: with log-ratios [0.1, 0.3] -> s = e^0.2
    # cispo: weight s = 1.221403 on each token, gradient -s A / 2 per token (per_token over 2 tokens)
    old = t([[-1.0, -1.0]])
    lp = (old + t([[0.1, 0.3]])).requires_grad_(True)
    out = loss_with(lp, old, None, t([1.0]), torch.ones(1, 2), beta=0.0, aggregation="per_token",
                    importance_level="sequence", policy_loss=name)  # fmt: skip
    out.loss.backward()
    s = math.exp(0.2)
    if name == "cispo":
        close(lp.grad, [[-s / 2, -s / 2]])
    assert torch.isfinite(lp.grad).all()
    assert lp.grad[0, 0] == lp.grad[0, 1]  # both tokens see the same ratio (sapo, clip, cispo alike)


def test_default_settings_match_the_plain_clip():
    # Every new knob at its default leaves the clipped loss of the loop in test_losses untouched.
    old, lp0, adv, mask, _ = random_batch(2)
    s = LossSettings(epsilon_high=0.28, aggregation="per_response")
    lp = lp0.clone().requires_grad_(True)
    got = policy_loss(LossInputs(lp, old, adv, mask), s, beta=0.0)
    a = adv.unsqueeze(1)
    r = torch.exp(lp0 - old)
    want = aggregate(-torch.minimum(r * a, r.clamp(0.8, 1.28) * a), mask, "per_response")
    assert got.loss.item() == want.item()


# --- adaptive entropy control --------------------------------------------------------------------------


def test_adaptive_entropy_coef_by_hand():
    """Skywork-OR1 / TRL `_compute_loss` (use_adaptive_entropy): after a step, coef + delta (at most max)
    when the entropy <= target, else coef - delta (at least min); the loss applies coef only while the
    last entropy <= target, none before the first measurement."""
    kw = dict(target=0.2, delta=0.005, low=0.0, high=1.0)
    # entropy 0.1 <= 0.2: 0.01 + 0.005 = 0.015; entropy 0.3: 0.01 - 0.005 = 0.005; floor and cap hold
    assert next_entropy_coef(0.01, 0.1, **kw) == pytest.approx(0.015)
    assert next_entropy_coef(0.01, 0.3, **kw) == pytest.approx(0.005)
    assert next_entropy_coef(0.002, 0.3, **kw) == 0.0
    assert next_entropy_coef(0.998, 0.1, **kw) == 1.0
    assert applied_entropy_coef(0.015, 0.1, target=0.2) == 0.015
    assert applied_entropy_coef(0.015, 0.3, target=0.2) == 0.0
    assert applied_entropy_coef(0.015, math.inf, target=0.2) == 0.0
