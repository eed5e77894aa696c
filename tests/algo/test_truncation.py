"""Truncated sampling's kept set and a sampled token's log-prob on both supports, worked numbers."""

import math
import random

import pytest
import torch

from grpo_run.algo.truncation import kept_tokens, sampled_logprobs, truncates

LOGITS = torch.tensor([[2.0, 1.0, 0.0, -1.0]])


def test_top_p_worked_numbers():
    # logits [2, 1, 0, -1], T = 1: e^z = [7.389056, 2.718282, 1, 0.367879], sum 11.475217 (log 2.440190)
    # -> p = [0.643914, 0.236883, 0.087144, 0.032059]. top_p = 0.8: the mass before each token, in
    # descending order, is [0, 0.643914, 0.880797, 0.967941]; tokens 2 and 3 have >= 0.8 before them and
    # go, so K = {0, 1} and Z = 0.643914 + 0.236883 = 0.880797 (log Z = -0.126928).
    out = sampled_logprobs(LOGITS.expand(2, 4), torch.tensor([0, 1]), temperature=1.0, top_k=0, top_p=0.8)
    # token 0: log p = 2 - 2.440190 = -0.440190; log q = log(0.643914 / 0.880797) = log 0.731059 = -0.313262
    # token 1: log p = 1 - 2.440190 = -1.440190; log q = log(0.236883 / 0.880797) = log 0.268941 = -1.313262
    torch.testing.assert_close(out.full, torch.tensor([-0.440190, -1.440190]), atol=1e-6, rtol=0)
    torch.testing.assert_close(out.truncated, torch.tensor([-0.313262, -1.313262]), atol=1e-6, rtol=0)
    torch.testing.assert_close(out.log_kept_mass, torch.tensor([-0.126928, -0.126928]), atol=1e-6, rtol=0)
    # A trainer equal to the sampler: exp(log pi_old - log q) = Z = 0.880797 on every token, not 1:
    # against the renormalised log-probs the ratio carries the kept mass (TRL #6789); against log p it is 1.
    assert math.exp(out.full[0] - out.truncated[0]) == pytest.approx(0.880797, abs=1e-6)


def test_temperature_then_top_k_worked_numbers():
    # T = 0.5: z / T = [4, 2, 0, -2], e^x = [54.598150, 7.389056, 1, 0.135335], sum 63.122541
    # (log 4.145078). top_k = 2: K = {0, 1}, Z = 61.987206 / 63.122541 = 0.982014 (log Z = -0.018150).
    # token 0: log p = 4 - 4.145078 = -0.145078; log q = log(54.598150 / 61.987206) = -0.126928.
    # token 2 is outside K: log p = 0 - 4.145078, log q = -inf (the sampler can never draw it).
    out = sampled_logprobs(LOGITS.expand(2, 4), torch.tensor([0, 2]), temperature=0.5, top_k=2, top_p=1.0)
    torch.testing.assert_close(out.full, torch.tensor([-0.145078, -4.145078]), atol=1e-6, rtol=0)
    assert out.truncated[0].item() == pytest.approx(-0.126928, abs=1e-6)
    assert out.truncated[1].item() == float("-inf")
    torch.testing.assert_close(out.log_kept_mass, torch.full((2,), -0.018150), atol=1e-6, rtol=0)


def test_min_p_worked_numbers():
    # p = [0.643914, 0.236883, 0.087144, 0.032059] (T = 1). min_p = 0.1 drops p < 0.1 * 0.643914 = 0.064391:
    # token 3 only. Z = 1 - 0.032059 = 0.967941 (log Z = -0.032584); token 0: log q = -0.440190 + 0.032584.
    out = sampled_logprobs(LOGITS, torch.tensor([0]), temperature=1.0, top_k=0, top_p=1.0, min_p=0.1)
    assert out.log_kept_mass.item() == pytest.approx(-0.032584, abs=1e-6)
    assert out.truncated.item() == pytest.approx(-0.407606, abs=1e-6)
    # min_p = 0.2: the threshold 0.128783 drops token 2 (0.087144) too.
    kept = kept_tokens(LOGITS, top_k=0, top_p=1.0, min_p=0.2)
    assert kept.tolist() == [[True, True, False, False]]


def test_top_p_applies_to_what_top_k_kept():
    # top_k = 3 keeps p = [0.643914, 0.236883, 0.087144], renormalised: [0.665241, 0.244727, 0.090031].
    # top_p = 0.66: 0.665241 >= 0.66 is already before token 1, so K = {0} (vLLM's order). On the full
    # distribution top-p would have kept token 1 (0.643914 < 0.66 before it).
    assert kept_tokens(LOGITS, top_k=3, top_p=0.66).tolist() == [[True, False, False, False]]
    assert kept_tokens(LOGITS, top_k=0, top_p=0.66).tolist() == [[True, True, False, False]]
    out = sampled_logprobs(LOGITS, torch.tensor([0]), temperature=1.0, top_k=3, top_p=0.66)
    assert out.truncated.item() == 0.0  # q = 1 on the only kept token
    assert out.log_kept_mass.item() == pytest.approx(-0.440190, abs=1e-6)  # Z = p_0


def test_nothing_dropped_gives_the_full_distribution():
    logits = torch.randn(5, 11, generator=torch.Generator().manual_seed(0))
    tokens = torch.arange(5)
    assert not truncates(top_k=0, top_p=1.0, min_p=0.0)
    assert truncates(top_k=0, top_p=0.9, min_p=0.0) and truncates(top_k=1, top_p=1.0, min_p=0.0)
    for top_k in (0, 11, 50):  # top_k >= V drops nothing
        out = sampled_logprobs(logits, tokens, temperature=0.7, top_k=top_k, top_p=1.0)
        assert torch.equal(out.truncated, out.full)
        assert torch.equal(out.log_kept_mass, torch.zeros(5))
        want = torch.log_softmax(logits / 0.7, dim=-1).gather(-1, tokens[:, None]).squeeze(-1)
        torch.testing.assert_close(out.full, want, atol=1e-6, rtol=0)


def test_ties_and_edges():
    # Logits tied at the k-th keep every tied token (as vLLM's top-k); top_p near 0 keeps the top token
    # only; min_p = 1 keeps the maximum (and its ties).
    tied = torch.tensor([[1.0, 1.0, 0.0]])
    assert kept_tokens(tied, top_k=1, top_p=1.0).tolist() == [[True, True, False]]
    assert kept_tokens(LOGITS, top_k=0, top_p=1e-6).tolist() == [[True, False, False, False]]
    assert kept_tokens(tied, top_k=0, top_p=1.0, min_p=1.0).tolist() == [[True, True, False]]
    # Two tokens (the smallest vocabulary): p = [0.731059, 0.268941]; top_p = 0.5 keeps the first.
    two = torch.tensor([[1.0, 0.0]])
    out = sampled_logprobs(two, torch.tensor([0]), temperature=1.0, top_k=0, top_p=0.5)
    assert out.truncated.item() == 0.0
    assert out.full.item() == pytest.approx(math.log(0.731059), abs=1e-6)


def _kept_by_loop(row: list[float], *, top_k: int, top_p: float, min_p: float) -> list[bool]:
    """One row by hand: min_p, then top-k, then top-p over the renormalised survivors."""
    v = len(row)
    peak = max(row)
    total = sum(math.exp(x - peak) for x in row)
    p = [math.exp(x - peak) / total for x in row]
    kept = [p[i] >= min_p * max(p) for i in range(v)]
    if 0 < top_k < v:
        kth = sorted((row[i] for i in range(v) if kept[i]), reverse=True)[:top_k][-1]
        kept = [kept[i] and row[i] >= kth for i in range(v)]
    if top_p < 1.0:
        mass = sum(p[i] for i in range(v) if kept[i])
        before = 0.0
        for i in sorted((i for i in range(v) if kept[i]), key=lambda i: -row[i]):
            if before >= top_p:
                kept[i] = False
            before += p[i] / mass
    return kept


def test_kept_set_and_logprobs_match_a_loop_reference():
    rng = random.Random(0)
    for _ in range(200):
        v = rng.randint(2, 9)
        # distinct logits: the loop and the sort may order ties differently
        row = rng.sample(range(-40, 40), v)
        logits = torch.tensor([[x / 10 for x in row]], dtype=torch.float64)
        top_k, top_p = rng.choice([0, 1, 2, 3, 50]), rng.choice([1.0, 0.9, 0.5, 0.2])
        min_p = rng.choice([0.0, 0.05, 0.3])
        want = _kept_by_loop(logits[0].tolist(), top_k=top_k, top_p=top_p, min_p=min_p)
        assert kept_tokens(logits, top_k=top_k, top_p=top_p, min_p=min_p)[0].tolist() == want
        token = rng.choice([i for i in range(v) if want[i]])
        out = sampled_logprobs(
            logits, torch.tensor([token]), temperature=1.0, top_k=top_k, top_p=top_p, min_p=min_p
        )
        p = torch.softmax(logits[0], dim=-1)
        z = sum(p[i].item() for i in range(v) if want[i])
        assert out.truncated.item() == pytest.approx(math.log(p[token].item() / z), abs=1e-12)
        assert out.log_kept_mass.item() == pytest.approx(math.log(z), abs=1e-12)
