"""Intervals for held-out numbers (grpo_run/algo/intervals.py): worked numbers with the arithmetic."""

import math

import pytest
import torch

from grpo_run.algo.intervals import (
    bootstrap_indices,
    bootstrap_mean_interval,
    flip_counts,
    intervals_overlap,
    paired_difference,
    pass_at_k,
    t_interval,
    t_quantile_975,
    wilson_interval,
)


def test_wilson_3_of_10():
    # p = 0.3, z^2 = 3.84146, denom = 1 + 3.84146/10 = 1.384146
    # center = (0.3 + 3.84146/20) / 1.384146 = 0.492073 / 1.384146 = 0.355507
    # half = 1.959964 * sqrt(0.3*0.7/10 + 3.84146/400) / 1.384146
    #      = 1.959964 * sqrt(0.021 + 0.0096037) / 1.384146 = 1.959964 * 0.174939 / 1.384146 = 0.247717
    low, high = wilson_interval(3, 10)
    assert low == pytest.approx(0.355507 - 0.247717, abs=1e-5)  # 0.10779
    assert high == pytest.approx(0.355507 + 0.247717, abs=1e-5)  # 0.60322


def test_wilson_0_of_10_is_not_empty():
    # p = 0: center = 0.192073/1.384146 = 0.138766; half = 1.959964*sqrt(0.0096037)/1.384146 = 0.138766
    # so low = 0 exactly and high = 2 * 0.138766 = 0.277532 (a Wald interval would be [0, 0])
    low, high = wilson_interval(0, 10)
    assert low == pytest.approx(0.0, abs=1e-12)
    assert high == pytest.approx(0.277532, abs=1e-5)


def test_wilson_10_of_10_mirrors_0_of_10():
    # p = 1: center = (1 + 0.192073)/1.384146 = 0.861234; half = 0.138766 -> [0.722468, 1]
    low, high = wilson_interval(10, 10)
    assert low == pytest.approx(1 - 0.277532, abs=1e-5)
    assert high == pytest.approx(1.0, abs=1e-12)


def test_wilson_without_trials_is_nan():
    assert all(math.isnan(x) for x in wilson_interval(0, 0))


def test_bootstrap_matches_a_direct_computation():
    values = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5])
    got = bootstrap_mean_interval(values, num_resamples=50, seed=7)
    # Direct: the same 50 draws of 5 indices, each resample's mean by hand, sorted; the 2.5% and 97.5%
    # quantiles interpolate linearly at positions 0.025*49 = 1.225 and 0.975*49 = 47.775.
    idx = bootstrap_indices(5, num_resamples=50, seed=7).tolist()
    means = sorted(sum(float(values[i]) for i in row) / 5 for row in idx)
    low = means[1] + 0.225 * (means[2] - means[1])
    high = means[47] + 0.775 * (means[48] - means[47])
    assert got.tolist() == pytest.approx([low, high], abs=1e-12)
    assert 0.0 <= low <= 0.5 <= high <= 1.0  # the sample mean 0.5 lies inside


def test_bootstrap_is_repeatable_and_degenerate_cases():
    values = torch.tensor([0.0, 1.0, 1.0, 0.0])
    assert torch.equal(bootstrap_mean_interval(values, seed=3), bootstrap_mean_interval(values, seed=3))
    # every problem scores 0.25: every resample's mean is 0.25
    assert bootstrap_mean_interval(torch.full((6,), 0.25)).tolist() == pytest.approx([0.25, 0.25])
    assert torch.isnan(bootstrap_mean_interval(torch.zeros(0))).all()


def test_pass_at_k_worked_numbers():
    c = torch.tensor([0, 1, 2, 3, 4])
    # n = 4, k = 2, C(4,2) = 6: c=0 -> 1 - 6/6 = 0; c=1 -> 1 - C(3,2)/6 = 1 - 3/6 = 0.5;
    # c=2 -> 1 - C(2,2)/6 = 5/6; c=3 -> 1 - C(1,2)/6 = 1 - 0 = 1; c=4 -> 1
    assert pass_at_k(c, num_samples=4, k=2).tolist() == pytest.approx([0, 0.5, 5 / 6, 1, 1])
    # k = 1 is the fraction correct c/n; k = n is "any sample correct"
    assert pass_at_k(c, num_samples=4, k=1).tolist() == pytest.approx([0, 0.25, 0.5, 0.75, 1])
    assert pass_at_k(c, num_samples=4, k=4).tolist() == [0, 1, 1, 1, 1]
    with pytest.raises(ValueError, match="k=5"):
        pass_at_k(c, num_samples=4, k=5)


def test_paired_flips_on_a_hand_made_pair():
    before = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 0.0])
    after = torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0, 0.0])
    # problem 1 and 3 went 0 -> 1 (up), problem 2 went 1 -> 0 (down); 0, 4, 5 unchanged
    assert flip_counts(before, after) == (2, 1)
    gain, (low, high) = paired_difference(before, after, num_resamples=500, seed=0)
    # mean of the differences [0, 1, -1, 1, 0, 0] = 1/6 (before 3/6, after 4/6: the same 1/6)
    assert gain == pytest.approx(1 / 6)
    assert -1 <= low <= gain <= high <= 1
    # identical before/after: no flips, a zero-width interval at 0
    assert flip_counts(before, before) == (0, 0)
    assert paired_difference(before, before)[1].tolist() == [0.0, 0.0]


def test_t_interval_on_three_seeds():
    # [1, 2, 3]: mean 2, sample sd = sqrt((1 + 0 + 1)/2) = 1, se = 1/sqrt(3) = 0.577350
    # t(0.975, df=2) = 4.302653 -> half = 4.302653 * 0.577350 = 2.484138
    mean, low, high = t_interval([1.0, 2.0, 3.0])
    assert mean == 2.0
    assert (low, high) == pytest.approx((2 - 2.484138, 2 + 2.484138), abs=1e-6)
    # two seeds [0.1, 0.3]: mean 0.2, sd = sqrt(2 * 0.01) = 0.141421, se = 0.1, t(1) = 12.706205
    mean, low, high = t_interval([0.1, 0.3])
    assert (mean, low, high) == pytest.approx((0.2, 0.2 - 1.2706205, 0.2 + 1.2706205))
    mean, low, high = t_interval([0.4])
    assert mean == 0.4 and math.isnan(low) and math.isnan(high)


def test_t_quantile_past_the_table():
    assert t_quantile_975(30) == pytest.approx(2.042272)
    assert t_quantile_975(31) == pytest.approx(2.039513, abs=1e-4)  # scipy.stats.t.ppf(0.975, 31)
    assert t_quantile_975(120) == pytest.approx(1.979930, abs=1e-4)
    with pytest.raises(ValueError):
        t_quantile_975(0)


def test_intervals_overlap():
    assert intervals_overlap((0.1, 0.3), (0.3, 0.5))  # touching counts as overlapping
    assert not intervals_overlap((0.1, 0.2), (0.25, 0.5))
    assert intervals_overlap((0.1, math.nan), (0.8, 0.9))  # one seed: cannot tell apart
