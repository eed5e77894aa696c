"""grpo.rollout_correction: the sampler/trainer importance weights, worked numbers (TRL 1.16's modes)."""

import math

import pytest
import torch

from grpo_run.algo import mismatch_stats, rollout_correction_weights
from tests.algo.loss_call import loss_with

LN = math.log


def _batch():
    """Row 0: rho_s = pi_old / pi_sampler = [2, 0.5, 4]; row 1: 1.5, then padding whose log-probs are
    -inf and NaN (garbage that must never reach a weight). sampler 0, old = log rho_s."""
    old = torch.tensor([[LN(2), LN(0.5), LN(4)], [LN(1.5), 0.7, 0.0]])
    sampler = torch.tensor([[0.0, 0.0, 0.0], [0.0, float("-inf"), float("nan")]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    return old, sampler, mask


@pytest.mark.parametrize(
    ("mode", "weights", "rejected"),
    [
        # none: the completion mask itself.
        ("none", [[1, 1, 1], [1, 0, 0]], [[0, 0, 0], [0, 0, 0]]),
        # token_tis: min(rho, 3) per token -> [2, 0.5, min(4, 3) = 3]; row 1: 1.5.
        ("token_tis", [[2, 0.5, 3], [1.5, 0, 0]], [[0, 0, 0], [0, 0, 0]]),
        # token_mask: rho where rho <= 3, else 0 -> the 4 is rejected.
        ("token_mask", [[2, 0.5, 0], [1.5, 0, 0]], [[0, 0, 1], [0, 0, 0]]),
        # sequence_tis: row 0's product 2 * 0.5 * 4 = 4 -> min(4, 3) = 3 on each token; row 1: 1.5.
        ("sequence_tis", [[3, 3, 3], [1.5, 0, 0]], [[0, 0, 0], [0, 0, 0]]),
        # sequence_mask (TRL's default): row 0's product 4 > 3 -> the whole completion leaves the loss.
        ("sequence_mask", [[0, 0, 0], [1.5, 0, 0]], [[1, 1, 1], [0, 0, 0]]),
    ],
)
def test_worked_numbers(mode, weights, rejected):
    old, sampler, mask = _batch()
    out = rollout_correction_weights(old, sampler, mask, mode=mode, cap=3.0)
    torch.testing.assert_close(out.weights, torch.tensor(weights, dtype=torch.float32))
    assert out.rejected.tolist() == [[bool(x) for x in r] for r in rejected]
    assert torch.isfinite(out.weights).all() and torch.isfinite(out.ratio).all()


def test_sequence_ratio_is_the_product_of_token_ratios():
    old, sampler, mask = _batch()
    seq = rollout_correction_weights(old, sampler, mask, mode="sequence_tis", cap=100.0)
    # 2 * 0.5 * 4 = 4 on every token of row 0; 1.5 on row 1's one token.
    torch.testing.assert_close(seq.ratio, torch.tensor([[4.0, 4.0, 4.0], [1.5, 0, 0]]))


def test_identical_sampler_gives_weight_one_in_every_mode():
    lp = torch.randn(4, 6)
    mask = torch.ones(4, 6)
    mask[1, 3:] = 0
    for mode in ("token_tis", "sequence_tis", "token_mask", "sequence_mask"):
        out = rollout_correction_weights(lp, lp.clone(), mask, mode=mode, cap=1.0)
        torch.testing.assert_close(out.weights, mask)
        assert not out.rejected.any()


def test_cap_below_ratio_one_and_bad_cap():
    old, sampler, mask = _batch()
    # cap 1: token_tis -> [min(2,1)=1, 0.5, 1]; row 1 min(1.5, 1) = 1.
    out = rollout_correction_weights(old, sampler, mask, mode="token_tis", cap=1.0)
    torch.testing.assert_close(out.weights, torch.tensor([[1.0, 0.5, 1.0], [1.0, 0, 0]]))
    with pytest.raises(ValueError, match="cap"):
        rollout_correction_weights(old, sampler, mask, mode="token_tis", cap=0.0)
    with pytest.raises(ValueError):
        rollout_correction_weights(old, sampler, mask, mode="token", cap=2.0)


def test_huge_log_ratio_stays_finite():
    old = torch.tensor([[500.0, 0.0]])
    sampler = torch.tensor([[0.0, 0.0]])
    mask = torch.ones(1, 2)
    out = rollout_correction_weights(old, sampler, mask, mode="sequence_tis", cap=3.0)
    torch.testing.assert_close(out.weights, torch.tensor([[3.0, 3.0]]))


def test_mismatch_stats_worked_numbers():
    old, sampler, mask = _batch()
    corr = rollout_correction_weights(old, sampler, mask, mode="token_mask", cap=3.0)
    s = mismatch_stats(old, sampler, mask, corr)
    # |diffs| = ln2 + ln2 + ln4 + ln1.5 = 0.6931 + 0.6931 + 1.3863 + 0.4055 = 3.1781; max ln4 = 1.3863.
    assert s.abs_diff_sum.item() == pytest.approx(3.1781, abs=1e-4)
    assert s.abs_diff_max.item() == pytest.approx(1.3863, abs=1e-4)
    # token ratios 2 + 0.5 + 4 + 1.5 = 8, max 4; one token rejected; 4 completion tokens.
    assert s.ratio_sum.item() == pytest.approx(8.0)
    assert s.ratio_max.item() == pytest.approx(4.0)
    assert s.rejected.item() == 1 and s.tokens.item() == 4


def test_policy_loss_token_weights_scale_the_surrogate_only():
    # mu = 1: ratio 1, A = +1 -> surrogate 1 per token; weights [2, 0.5] -> per_token aggregation:
    # loss = -(2 * 1 + 0.5 * 1) / 2 = -1.25; gradient d loss / d logprob_t = -w_t / 2 = [-1, -0.25].
    lp = torch.zeros(1, 2, requires_grad=True)
    mask = torch.ones(1, 2)
    common = dict(epsilon=0.2, epsilon_high=0.2, aggregation="per_token")
    w = torch.tensor([[2.0, 0.5]])
    out = loss_with(lp, lp.detach(), None, torch.ones(1), mask, beta=0.0, token_weights=w, **common)
    assert out.loss.item() == pytest.approx(-1.25)
    out.loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[-1.0, -0.25]]))
    # The KL term is not weighted: beta 0.5, d = ln 2 on both tokens -> kl = 0.3069 each;
    # loss = -1.25 + 0.5 * 0.3069 = -1.0966.
    lp2 = torch.zeros(1, 2, requires_grad=True)
    ref = torch.full((1, 2), LN(2))
    out = loss_with(lp2, lp2.detach(), ref, torch.ones(1), mask, beta=0.5, token_weights=w, **common)
    assert out.loss.item() == pytest.approx(-1.25 + 0.5 * 0.30685, abs=1e-4)


def test_policy_loss_unit_weights_change_nothing():
    torch.manual_seed(0)
    lp = torch.randn(3, 5, requires_grad=True)
    old = lp.detach() + 0.1 * torch.randn(3, 5)
    adv = torch.tensor([1.0, -0.5, 0.3])
    mask = torch.ones(3, 5)
    common = dict(epsilon=0.2, epsilon_high=0.28, beta=0.0, aggregation="per_response")
    a = loss_with(lp, old, None, adv, mask, **common)
    b = loss_with(lp, old, None, adv, mask, token_weights=torch.ones(3, 5), **common)
    assert a.loss.item() == b.loss.item()


@pytest.mark.parametrize(
    ("mode", "weights", "rejected"),
    [
        # floor 0.8 (IcePop's lower bound, TRL vllm_importance_sampling_clip_min): token_tis raises the
        # 0.5 to 0.8 -> [2, 0.8, min(4, 3) = 3]; row 1: 1.5 inside the band.
        ("token_tis", [[2, 0.8, 3], [1.5, 0, 0]], [[0, 0, 0], [0, 0, 0]]),
        # token_mask drops both the 0.5 (< 0.8) and the 4 (> 3).
        ("token_mask", [[2, 0, 0], [1.5, 0, 0]], [[0, 1, 1], [0, 0, 0]]),
        # sequence level: row 1's 1.5 stays; a floor of 2 would drop it (next case's row 1).
        ("sequence_tis", [[3, 3, 3], [1.5, 0, 0]], [[0, 0, 0], [0, 0, 0]]),
    ],
)
def test_floor_worked_numbers(mode, weights, rejected):
    old, sampler, mask = _batch()
    out = rollout_correction_weights(old, sampler, mask, mode=mode, cap=3.0, floor=0.8)
    torch.testing.assert_close(out.weights, torch.tensor(weights, dtype=torch.float32))
    assert out.rejected.tolist() == [[bool(x) for x in r] for r in rejected]
    # sequence_mask with floor 2: row 0's 4 > 3 and row 1's 1.5 < 2 -> everything leaves the loss
    out = rollout_correction_weights(old, sampler, mask, mode="sequence_mask", cap=3.0, floor=2.0)
    assert out.weights.sum() == 0 and out.rejected.sum() == 4


def test_floor_equals_trl():
    """TRL `grpo_trainer.py` `_generate_and_score_completions`: *_truncate clamps the ratio to
    [clip_min, clip_max]; *_mask fills 0 where ratio < clip_min or > clip_max."""
    torch.manual_seed(0)
    old, sampler = torch.randn(4, 6), torch.randn(4, 6)
    mask = torch.ones(4, 6)
    ratio = torch.exp(old - sampler)
    trl_truncate = torch.clamp(ratio, min=0.5, max=2.0)
    trl_mask = ratio.masked_fill((ratio < 0.5) | (ratio > 2.0), value=0.0)
    for mode, want in (("token_tis", trl_truncate), ("token_mask", trl_mask)):
        got = rollout_correction_weights(old, sampler, mask, mode=mode, cap=2.0, floor=0.5).weights
        torch.testing.assert_close(got, want)


def test_floor_must_lie_below_the_cap():
    old, sampler, mask = _batch()
    with pytest.raises(ValueError, match="floor"):
        rollout_correction_weights(old, sampler, mask, mode="token_tis", cap=3.0, floor=3.0)
