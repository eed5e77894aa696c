"""95% intervals for held-out numbers: Wilson, percentile bootstrap over problems, pass@k, paired
differences with flip counts, and Student's t over seeds.

Pure: plain numbers or 1-D tensors in, plain numbers or tensors out; no I/O, no config. Every interval
here is two-sided at 95% (the t table and z are for that level only).
"""

import math

import torch

Z_95 = 1.959963984540054  # the standard normal's 97.5% quantile

# Student's t 97.5% quantiles for 1..30 degrees of freedom (two-sided 95%).
_T_975 = (
    12.706205,
    4.302653,
    3.182446,
    2.776445,
    2.570582,
    2.446912,
    2.364624,
    2.306004,
    2.262157,
    2.228139,
    2.200985,
    2.178813,
    2.160369,
    2.144787,
    2.131450,
    2.119905,
    2.109816,
    2.100922,
    2.093024,
    2.085963,
    2.079614,
    2.073873,
    2.068658,
    2.063899,
    2.059539,
    2.055529,
    2.051831,
    2.048407,
    2.045230,
    2.042272,
)


def wilson_interval(successes: int, trials: int, *, z: float = Z_95) -> tuple[float, float]:
    """Wilson score interval of a binomial rate; (nan, nan) for no trials.

    Unlike the normal (Wald) interval it stays inside [0, 1] and is not empty at 0/n or n/n, which is
    where a small model's held-out accuracy often sits.
    """
    if trials <= 0:
        return math.nan, math.nan
    p = successes / trials
    z2 = z * z
    denom = 1 + z2 / trials
    center = (p + z2 / (2 * trials)) / denom
    half = z * math.sqrt(p * (1 - p) / trials + z2 / (4 * trials * trials)) / denom
    return max(0.0, center - half), min(1.0, center + half)


def bootstrap_indices(n: int, *, num_resamples: int, seed: int) -> torch.Tensor:
    """The resampled problem indices, `[num_resamples, n]`, drawn from a generator seeded by `seed`."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, n, (num_resamples, n), generator=generator)  # [R, n]


def bootstrap_mean_interval(
    values: torch.Tensor, *, num_resamples: int = 2000, seed: int = 0, confidence: float = 0.95
) -> torch.Tensor:
    """Percentile bootstrap interval `[low, high]` of the mean of per-problem `values` `[n]`.

    Problems are the resampling unit (the k samples of one problem stay together), so the interval
    covers the variation from which problems were drawn, not only the sampling noise. A fixed seed
    makes two reports of the same numbers agree. Empty input gives `[nan, nan]`.
    """
    values = values.to(torch.float64)
    if values.numel() == 0:
        return torch.full((2,), math.nan, dtype=torch.float64)
    idx = bootstrap_indices(values.numel(), num_resamples=num_resamples, seed=seed)  # [R, n]
    means = values[idx].mean(dim=1)  # [R]
    alpha = (1 - confidence) / 2
    q = torch.tensor([alpha, 1 - alpha], dtype=torch.float64)
    return torch.quantile(means, q)  # [2], linear interpolation between order statistics


def pass_at_k(num_correct: torch.Tensor, *, num_samples: int, k: int) -> torch.Tensor:
    """Unbiased pass@k per problem from `num_samples` samples of which `num_correct` `[P]` are correct
    (Chen et al. 2021): 1 - C(n - c, k) / C(n, k), the chance that k of the n samples drawn without
    replacement hold at least one correct one."""
    if not 1 <= k <= num_samples:
        raise ValueError(f"pass@k needs 1 <= k <= num_samples, got k={k}, num_samples={num_samples}")
    total = math.comb(num_samples, k)
    out = [1.0 - math.comb(num_samples - c, k) / total for c in num_correct.tolist()]
    return torch.tensor(out, dtype=torch.float64)  # [P]


def flip_counts(before: torch.Tensor, after: torch.Tensor) -> tuple[int, int]:
    """Problems that went wrong -> right (up) and right -> wrong (down) between two 0/1 vectors `[P]`."""
    b, a = before.bool(), after.bool()
    return int((~b & a).sum()), int((b & ~a).sum())


def paired_difference(
    before: torch.Tensor, after: torch.Tensor, *, num_resamples: int = 2000, seed: int = 0
) -> tuple[float, torch.Tensor]:
    """Mean of `after - before` over the same problems `[P]` and its bootstrap interval `[2]`.

    Pairing removes the spread between easy and hard problems that an unpaired comparison of two
    intervals would carry twice; only problems that changed move the interval.
    """
    diff = after.to(torch.float64) - before.to(torch.float64)  # [P]
    mean = float(diff.mean()) if diff.numel() else math.nan
    return mean, bootstrap_mean_interval(diff, num_resamples=num_resamples, seed=seed)


def t_quantile_975(df: int) -> float:
    """Student's t 97.5% quantile (two-sided 95%) for `df` >= 1 degrees of freedom.

    A table up to 30; beyond it the first two terms of the Cornish-Fisher expansion around z
    (error below 1e-3 at df = 31).
    """
    if df < 1:
        raise ValueError(f"t quantile needs df >= 1, got {df}")
    if df <= len(_T_975):
        return _T_975[df - 1]
    z = Z_95
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df * df)


def t_interval(values: list[float]) -> tuple[float, float, float]:
    """(mean, low, high): the 95% Student-t interval of the mean of a few values (e.g. one per seed).

    With one value the mean has no interval: (value, nan, nan).
    """
    n = len(values)
    if n == 0:
        return math.nan, math.nan, math.nan
    mean = sum(values) / n
    if n == 1:
        return mean, math.nan, math.nan
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))  # sample std (n - 1)
    half = t_quantile_975(n - 1) * sd / math.sqrt(n)
    return mean, mean - half, mean + half


def intervals_overlap(a: tuple[float, float], b: tuple[float, float]) -> bool:
    """Whether two closed intervals share a point (an interval with a nan bound overlaps everything:
    with one seed nothing can be told apart)."""
    if any(math.isnan(x) for x in (*a, *b)):
        return True
    return a[0] <= b[1] and b[0] <= a[1]
