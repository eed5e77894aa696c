"""Group-relative advantages: DESIGN.md §Math worked numbers, edge cases, and a plain-loop reference."""

import math
import random

import pytest
import torch

from grpo_run.algo import (
    ADVANTAGE_FUNCTIONS,
    AdvantageMode,
    StdCorrection,
    compute_advantages,
    group_stats,
    normalize_then_sum,
    zero_std_groups,
)

EPS = 1e-6
TOL = 1e-4


def adv(rows, mode, correction="population", eps=EPS, valid=None):
    rewards = torch.tensor(rows, dtype=torch.float32)
    valid_t = None if valid is None else torch.tensor(valid, dtype=torch.bool)
    return compute_advantages(rewards, mode, correction, eps, valid=valid_t)


def close(got, expected, tol=TOL):
    torch.testing.assert_close(got, torch.tensor(expected, dtype=got.dtype), atol=tol, rtol=0)


# --- DESIGN.md §Math worked numbers (eps = 1e-6) -------------------------------------------------


def test_design_1_3_2_6_population():
    # mu = 12/4 = 3; deviations -2, 0, -1, 3; squares 4 + 0 + 1 + 9 = 14; var = 14/4 = 3.5
    # sigma = sqrt(3.5) = 1.870829; A = -2/1.870829, 0, -1/1.870829, 3/1.870829
    close(adv([[1, 3, 2, 6]], "normalized"), [[-1.0690, 0.0, -0.5345, 1.6036]])


def test_design_1_0_0_0_population():
    # mu = 0.25; deviations 0.75, -0.25 x3; squares 0.5625 + 3 * 0.0625 = 0.75; var = 0.75/4 = 0.1875
    # sigma = 0.433013; A = 0.75/0.433013 = 1.7320, -0.25/0.433013 = -0.5773
    close(adv([[1, 0, 0, 0]], "normalized"), [[1.7320, -0.5773, -0.5773, -0.5773]])


def test_design_sample_examples():
    # [1, 2, 0.5, 1.5]: mu = 5/4 = 1.25; deviations -0.25, 0.75, -0.75, 0.25
    #   squares 0.0625 + 0.5625 + 0.5625 + 0.0625 = 1.25; var = 1.25/3 = 0.416667; sigma = 0.645497
    #   A = -0.25/0.645497 = -0.3873, 0.75/0.645497 = 1.1619, ...
    # [5, 6, 5.5, 7]: mu = 23.5/4 = 5.875; deviations -0.875, 0.125, -0.375, 1.125
    #   squares 0.765625 + 0.015625 + 0.140625 + 1.265625 = 2.1875; var = 2.1875/3 = 0.729167
    #   sigma = 0.853913; A = -0.875/0.853913 = -1.0247, 0.1464, -0.4392, 1.3175
    got = adv([[1, 2, 0.5, 1.5], [5, 6, 5.5, 7]], "normalized", "sample")
    close(got, [[-0.3873, 1.1619, -1.1619, 0.3873], [-1.0247, 0.1464, -0.4392, 1.3175]])


def test_design_1_0_0_1_three_ways():
    # mu = 0.5, deviations +-0.5, squares 4 * 0.25 = 1
    # population: var = 1/4, sigma = 0.5 -> +-0.5/0.500001 = +-1
    close(adv([[1, 0, 0, 1]], "normalized", "population"), [[1.0, -1.0, -1.0, 1.0]])
    # sample: var = 1/3, sigma = 0.577350 -> +-0.5/0.577350 = +-0.8660
    close(adv([[1, 0, 0, 1]], "normalized", "sample"), [[0.8660, -0.8660, -0.8660, 0.8660]])
    # centered: r - 0.5
    close(adv([[1, 0, 0, 1]], "centered"), [[0.5, -0.5, -0.5, 0.5]])


# --- the added modes, by hand ---------------------------------------------------------------------


def test_rloo_1_0_0_0():
    # member 0: baseline mean(0, 0, 0) = 0 -> 1 - 0 = 1
    # member 1: baseline mean(1, 0, 0) = 1/3 -> 0 - 1/3 = -1/3 (same for members 2, 3)
    close(adv([[1, 0, 0, 0]], "rloo"), [[1.0, -1 / 3, -1 / 3, -1 / 3]])


def test_raw_is_rewards():
    close(adv([[1, 3, 2, 6]], "raw"), [[1.0, 3.0, 2.0, 6.0]])


def test_normalized_batch_two_groups():
    # groups [0, 1] and [2, 4]; group means 0.5 and 3 -> centered [-0.5, 0.5], [-1, 1]
    # step rewards 0, 1, 2, 4: mean 7/4 = 1.75; deviations -1.75, -0.75, 0.25, 2.25
    # squares 3.0625 + 0.5625 + 0.0625 + 5.0625 = 8.75
    # population: var = 8.75/4 = 2.1875, sigma = 1.479020 -> 0.5/1.479020 = 0.338062, 1/1.479020 = 0.676123
    got = adv([[0, 1], [2, 4]], "normalized_batch", "population", eps=0.0)
    close(got, [[-0.338062, 0.338062], [-0.676123, 0.676123]])
    # sample: var = 8.75/3 = 2.916667, sigma = 1.707825 -> 0.292770, 0.585540
    got = adv([[0, 1], [2, 4]], "normalized_batch", "sample", eps=0.0)
    close(got, [[-0.292770, 0.292770], [-0.585540, 0.585540]])


def test_normalized_batch_keeps_zero_std_group_at_zero():
    # group [3, 3] has no signal even though the step's std (over 0, 1, 3, 3) is not 0
    got = adv([[0, 1], [3, 3]], "normalized_batch")
    assert torch.equal(got[1], torch.zeros(2))


# --- edge cases -----------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", list(AdvantageMode))
@pytest.mark.parametrize("correction", list(StdCorrection))
@pytest.mark.parametrize("value", [0.0, 1.0, 0.1, -7.3, 1e6])
def test_all_equal_group_is_exactly_zero(mode, correction, value):
    # 0.1 * 3 / 3 != 0.1 in floating point: the zero must not rely on the mean rounding back.
    got = adv([[value] * 3, [1, 0, 1]], mode, correction)
    assert not torch.isnan(got).any()
    if mode is AdvantageMode.RAW:
        assert torch.equal(got[0], torch.full((3,), value))
    else:
        assert torch.equal(got[0], torch.zeros(3))


def test_group_size_two():
    # [1, 0]: mu = 0.5; population sigma = 0.5 -> +-1; sample sigma = sqrt(0.5/1) = 0.707107 -> +-0.707107
    close(adv([[1, 0]], "normalized", "population"), [[1.0, -1.0]])
    close(adv([[1, 0]], "normalized", "sample"), [[0.707107, -0.707107]])
    close(adv([[1, 0]], "centered"), [[0.5, -0.5]])
    # rloo: 1 - 0 = 1, 0 - 1 = -1
    close(adv([[1, 0]], "rloo"), [[1.0, -1.0]])


def test_invalid_member_excluded_and_zero():
    # member 2 is unscorable (placeholder NaN). Valid rewards 1, 0, 0: mu = 1/3
    # population var = ((2/3)^2 + 2 * (1/3)^2)/3 = (4/9 + 2/9)/3 = 2/9, sigma = 0.471405
    # A = (2/3)/0.471405 = 1.414214, (-1/3)/0.471405 = -0.707107; invalid -> 0
    rows, valid = [[1, 0, float("nan"), 0]], [[True, True, False, True]]
    close(adv(rows, "normalized", valid=valid), [[1.414214, -0.707107, 0.0, -0.707107]])
    close(adv(rows, "centered", valid=valid), [[2 / 3, -1 / 3, 0.0, -1 / 3]])
    # rloo: 1 - mean(0, 0) = 1; 0 - mean(1, 0) = -0.5
    close(adv(rows, "rloo", valid=valid), [[1.0, -0.5, 0.0, -0.5]])
    # raw keeps the valid rewards but zeroes the invalid one (even in raw mode)
    close(adv(rows, "raw", valid=valid), [[1.0, 0.0, 0.0, 0.0]])


@pytest.mark.parametrize("mode", list(AdvantageMode))
def test_fewer_than_two_valid_members(mode):
    rows, valid = [[5.0, 9.0, 2.0], [4.0, 4.0, 4.0]], [[False, True, False], [False, False, False]]
    got = adv(rows, mode, valid=valid)
    expected = [[0.0, 9.0, 0.0], [0.0, 0.0, 0.0]] if mode is AdvantageMode.RAW else [[0.0] * 3] * 2
    assert torch.equal(got, torch.tensor(expected))


def test_enum_or_string_accepted():
    rewards = torch.tensor([[1.0, 3.0, 2.0, 6.0]])
    a = compute_advantages(rewards, AdvantageMode.NORMALIZED, StdCorrection.SAMPLE, EPS)
    b = compute_advantages(rewards, "normalized", "sample", EPS)
    assert torch.equal(a, b)
    with pytest.raises(ValueError):
        compute_advantages(rewards, "zscore", "sample", EPS)


def test_integer_rewards_become_float():
    got = compute_advantages(torch.tensor([[1, 0, 0, 0]]), "centered", "population", EPS)
    close(got, [[0.75, -0.25, -0.25, -0.25]])


def test_group_stats_and_zero_std():
    rewards = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 1.0], [2.0, 7.0, 2.0]])
    valid = torch.tensor([[True] * 3, [True] * 3, [True, False, True]])
    # row 2's only differing member is invalid -> all valid rewards equal
    assert torch.equal(zero_std_groups(rewards, valid), torch.tensor([True, False, True]))
    stats = group_stats(rewards, valid, std_correction="sample")
    # row 1: mu = 2/3; sample var = ((1/3)^2 * 2 + (2/3)^2)/2 = (2/9 + 4/9)/2 = 1/3; sigma = 0.577350
    close(stats.mean, [1.0, 2 / 3, 2.0])
    close(stats.std, [0.0, 0.577350, 0.0])
    assert stats.count.tolist() == [3, 3, 2]


def test_table_covers_every_mode():
    assert set(ADVANTAGE_FUNCTIONS) == set(AdvantageMode)


# --- vectorised vs plain-Python loop --------------------------------------------------------------


def reference(rows, valid, mode, correction, eps):
    """One group at a time, plain floats."""
    flat = [r for row, vrow in zip(rows, valid) for r, v in zip(row, vrow) if v]

    def std(values):
        n = len(values)
        m = sum(values) / n
        denom = n if correction == "population" else n - 1
        return math.sqrt(sum((x - m) ** 2 for x in values) / max(denom, 1))

    out = []
    for row, vrow in zip(rows, valid):
        members = [r for r, v in zip(row, vrow) if v]
        n = len(members)
        flat_group = n < 2 or max(members) == min(members)
        res = []
        for r, v in zip(row, vrow):
            if not v:
                res.append(0.0)
            elif mode == "raw":
                res.append(r)
            elif flat_group:
                res.append(0.0)
            elif mode == "centered":
                res.append(r - sum(members) / n)
            elif mode == "normalized":
                res.append((r - sum(members) / n) / (std(members) + eps))
            elif mode == "rloo":
                res.append(r - (sum(members) - r) / (n - 1))
            else:  # normalized_batch
                res.append((r - sum(members) / n) / (std(flat) + eps))
        out.append(res)
    return out


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("mode", [m.value for m in AdvantageMode])
@pytest.mark.parametrize("correction", ["population", "sample"])
def test_matches_loop_reference(seed, mode, correction):
    rng = random.Random(seed)
    b, g = rng.randint(1, 6), rng.randint(2, 8)
    # binary rewards make ties and zero-std groups common; continuous ones test the arithmetic
    if seed % 2:
        rows = [[float(rng.randint(0, 1)) for _ in range(g)] for _ in range(b)]
    else:
        rows = [[rng.uniform(-3, 3) for _ in range(g)] for _ in range(b)]
    valid = [[rng.random() > 0.2 for _ in range(g)] for _ in range(b)]
    rewards = torch.tensor(rows, dtype=torch.float64)
    got = compute_advantages(rewards, mode, correction, EPS, valid=torch.tensor(valid))
    expected = torch.tensor(reference(rows, valid, mode, correction, EPS), dtype=torch.float64)
    torch.testing.assert_close(got, expected, atol=1e-9, rtol=0)


# --- GDPO: reward.aggregation=normalize_then_sum ---------------------------------------------------


def gdpo(per_fn, weights, correction="population", eps=0.0, valid=None):
    rewards = torch.tensor(per_fn, dtype=torch.float64)  # [B, G, K]
    valid_t = None if valid is None else torch.tensor(valid, dtype=torch.bool)
    return normalize_then_sum(rewards, torch.tensor(weights, dtype=torch.float64), correction, eps, valid_t)


def test_gdpo_worked_numbers():
    # group 0: f1 = [1, 0] -> mean 0.5, std 0.5 -> [1, -1]; f2 = [0, 0] constant -> [0, 0]
    # group 1: f1 = [1, 1] constant -> [0, 0]; f2 = [2, 0] -> mean 1, std 1 -> [1, -1]
    per_fn = [[[1, 0], [0, 0]], [[1, 2], [1, 0]]]  # [B=2, G=2, K=2]
    # weights [1, 1]: sums [1, -1, 1, -1]; over the step mean 0, std 1 -> unchanged
    close(gdpo(per_fn, [1.0, 1.0]), [[1, -1], [1, -1]])
    # weights [1, 2]: sums [1, -1, 2, -2]; std sqrt((1 + 1 + 4 + 4) / 4) = 1.581139
    # -> [0.632456, -0.632456, 1.264911, -1.264911]
    close(gdpo(per_fn, [1.0, 2.0]), [[0.632456, -0.632456], [1.264911, -1.264911]])
    # the weighted sum first (sum_then_normalize): totals [1, 0] and [5, 1] -> [1, -1] in both groups
    close(adv([[1, 0], [5, 1]], "normalized", eps=0.0), [[1, -1], [1, -1]])


def test_gdpo_keeps_flat_groups_at_zero_and_skips_invalid_members():
    # group 1 is constant in every function -> exactly 0; group 0 as above (its std over the step
    # counts group 1's zeros: sums [1, -1, 0, 0] -> std sqrt(2 / 4) = 0.707107 -> [1.414214, -1.414214])
    per_fn = [[[1, 0], [0, 0]], [[3, 3], [3, 3]]]
    close(gdpo(per_fn, [1.0, 1.0]), [[1.414214, -1.414214], [0, 0]])
    # an invalid member is left out and gets 0: group 0 = f1 [1, 0, (9)] -> [1, -1, 0]
    per_fn = [[[1, 0], [0, 0], [9, 9]]]
    close(gdpo(per_fn, [1.0, 1.0], valid=[[True, True, False]]), [[1, -1, 0]])


def test_gdpo_equals_trl():
    """TRL `grpo_trainer.py` `_generate_and_score_completions`, multi_objective_aggregation=
    "normalize_then_sum": per function (r - nanmean) / (nanstd + 1e-4) over the group (nanstd has
    Bessel's correction), weighted nansum, then (s - nanmean) / (nanstd + 1e-4) over the batch."""
    g = torch.Generator().manual_seed(0)
    rewards = torch.rand(3, 4, 3, generator=g, dtype=torch.float64)  # [B, G, K]
    weights = torch.tensor([1.0, 0.5, 2.0], dtype=torch.float64)

    def nanstd(x, dim=None, keepdim=False):
        mean = torch.nanmean(x, dim=dim, keepdim=True)
        var = torch.nanmean((x - mean) ** 2, dim=dim, keepdim=True)
        count = torch.sum(~torch.isnan(x), dim=dim, keepdim=True)
        var = var * count / (count - 1)
        out = torch.sqrt(var)
        return out if keepdim or dim is None else out.squeeze(dim)

    grouped = rewards  # TRL's rewards_per_func.view(-1, num_generations, K)
    mean_k = torch.nanmean(grouped, dim=1, keepdim=True)
    std_k = nanstd(grouped, dim=1, keepdim=True)
    reward_k = ((grouped - mean_k) / (std_k + 1e-4)).view(-1, 3)
    summed = (reward_k * weights.unsqueeze(0)).nansum(dim=1)
    trl = (summed - torch.nanmean(summed)) / (nanstd(summed).squeeze() + 1e-4)
    got = normalize_then_sum(rewards, weights, "sample", 1e-4)
    torch.testing.assert_close(got.reshape(-1), trl)


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("correction", ["population", "sample"])
def test_gdpo_matches_loop(seed, correction):
    rng = random.Random(seed)
    b, g, k = rng.randint(1, 4), rng.randint(2, 5), rng.randint(1, 3)
    per_fn = [[[float(rng.randint(0, 2)) for _ in range(k)] for _ in range(g)] for _ in range(b)]
    valid = [[rng.random() > 0.15 for _ in range(g)] for _ in range(b)]
    weights = [rng.uniform(0.2, 2) for _ in range(k)]
    eps = 1e-6

    def std(xs, mean):
        n = len(xs) if correction == "population" else len(xs) - 1
        return math.sqrt(sum((x - mean) ** 2 for x in xs) / max(n, 1))

    sums = {}
    flat_groups = set()
    for i in range(b):
        members = [j for j in range(g) if valid[i][j]]
        constant = True
        for j in members:
            sums[i, j] = 0.0
        for f in range(k):
            xs = [per_fn[i][j][f] for j in members]
            if len(set(xs)) > 1:
                constant = False
            if len(set(xs)) < 2 or len(xs) < 2:
                continue  # no spread in this group: the function adds 0
            mean = sum(xs) / len(xs)
            sd = std(xs, mean)
            for j in members:
                sums[i, j] += weights[f] * (per_fn[i][j][f] - mean) / (sd + eps)
        if constant:
            flat_groups.add(i)
    values = list(sums.values())
    mean = sum(values) / max(len(values), 1)
    sd = std(values, mean)
    want = [
        [
            0.0 if (i, j) not in sums or i in flat_groups else (sums[i, j] - mean) / (sd + eps)
            for j in range(g)
        ]
        for i in range(b)
    ]
    got = gdpo(per_fn, weights, correction, eps, valid)
    close(got, want, 1e-9)
