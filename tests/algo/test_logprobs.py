"""Chunked token log-probs and entropies equal the full log-softmax, values and gradients."""

import pytest
import torch

from grpo_run.algo import token_entropy, token_logprobs, token_logprobs_and_entropy


def full_logprobs(logits, targets, temperature):
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)  # [N, T, V]
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # [N, T]


def full_entropy(logits, temperature):
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)  # [N, T, V]
    return -(logp.exp() * logp).sum(-1)  # [N, T]


def make(seed=0, n=3, tt=5, v=37, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(n, tt, v, generator=g)).to(dtype)  # [N, T, V]
    targets = torch.randint(0, v, (n, tt), generator=g)  # [N, T]
    return logits, targets


def test_by_hand():
    # logits [0, ln 3] -> softmax [1/4, 3/4]; target 1 -> log 0.75 = -0.287682
    # entropy = -(0.25 ln 0.25 + 0.75 ln 0.75) = 0.346574 + 0.215762 = 0.562335
    logits = torch.tensor([[[0.0, torch.log(torch.tensor(3.0)).item()]]])
    torch.testing.assert_close(token_logprobs(logits, torch.tensor([[1]])), torch.tensor([[-0.287682]]))
    torch.testing.assert_close(token_entropy(logits), torch.tensor([[0.562335]]))
    lp, ent = token_logprobs_and_entropy(logits, torch.tensor([[1]]))
    torch.testing.assert_close((lp, ent), (torch.tensor([[-0.287682]]), torch.tensor([[0.562335]])))


@pytest.mark.parametrize("chunk_size", [1, 4, 7, 15, 1000])
@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.3])
def test_matches_full_log_softmax_value_and_grad(chunk_size, temperature):
    logits0, targets = make()
    # [N, T] an arbitrary downstream weighting
    upstream = torch.randn(3, 5, generator=torch.Generator().manual_seed(3))

    logits = logits0.clone().requires_grad_(True)
    got = token_logprobs(logits, targets, temperature, chunk_size=chunk_size)
    (got * upstream).sum().backward()

    ref_logits = logits0.clone().requires_grad_(True)
    expected = full_logprobs(ref_logits, targets, temperature)
    (expected * upstream).sum().backward()

    assert got.dtype == torch.float32 and got.shape == (3, 5)
    # 1e-6 absolute, plus float32 rounding (1 ulp ~ 1.2e-7 relative) on log-probs near -16
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(logits.grad, ref_logits.grad, atol=1e-6, rtol=0)


@pytest.mark.parametrize("chunk_size", [1, 4, 7, 15, 1000])
@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.3])
def test_entropy_matches_full_value_and_grad(chunk_size, temperature):
    logits0, _ = make(seed=1)
    upstream = torch.randn(3, 5, generator=torch.Generator().manual_seed(4))

    logits = logits0.clone().requires_grad_(True)
    got = token_entropy(logits, temperature, chunk_size=chunk_size)
    (got * upstream).sum().backward()

    ref_logits = logits0.clone().requires_grad_(True)
    expected = full_entropy(ref_logits, temperature)
    (expected * upstream).sum().backward()

    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(logits.grad, ref_logits.grad, atol=1e-6, rtol=0)


def test_gradcheck_float64():
    logits, targets = make(n=2, tt=3, v=6, dtype=torch.float64)
    logits.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda x: token_logprobs(x, targets, 0.8, chunk_size=4), (logits,))
    assert torch.autograd.gradcheck(lambda x: token_entropy(x, 0.8, chunk_size=4), (logits,))


def test_bf16_logits_give_float32_and_match_upcast():
    logits, targets = make(dtype=torch.bfloat16)
    got = token_logprobs(logits, targets, 0.7, chunk_size=4)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, full_logprobs(logits, targets, 0.7), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(
        token_entropy(logits, 0.7, chunk_size=4), full_entropy(logits, 0.7), atol=1e-5, rtol=0
    )


def test_only_the_logits_are_saved_for_backward():
    # A full float32 [N, T, V] copy kept for backward would defeat the chunking: autograd may keep
    # only the (bf16) logits and the targets.
    logits, targets = make(dtype=torch.bfloat16)
    logits.requires_grad_(True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda x: saved.append(x) or x, lambda x: x):
        token_logprobs(logits, targets, chunk_size=4)
        token_entropy(logits, chunk_size=4)
        token_logprobs_and_entropy(logits, targets, chunk_size=4)
    big = [x for x in saved if x.numel() >= logits.numel()]
    assert all(x.dtype == torch.bfloat16 for x in big)


def test_no_grad_and_bad_arguments():
    logits, targets = make()
    with torch.no_grad():
        assert not token_logprobs(logits, targets).requires_grad
    with pytest.raises(ValueError):
        token_logprobs(logits, targets, temperature=0.0)
    with pytest.raises(ValueError):
        token_entropy(logits, chunk_size=0)


def test_entropy_with_minus_inf_logits_is_finite():
    # logits [0, 0, -inf] -> p = [1/2, 1/2, 0] -> entropy ln 2 = 0.693147, gradient finite
    logits = torch.tensor([[[0.0, 0.0, -torch.inf]]], requires_grad=True)
    ent = token_entropy(logits)
    ent.sum().backward()
    torch.testing.assert_close(ent, torch.tensor([[0.693147]]))
    assert torch.isfinite(logits.grad).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_size", [1, 4, 1000])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fused_logprobs_and_entropy_equal_the_separate_passes(dtype, chunk_size, temperature):
    # The update's pass: log-probs with gradient and the entropy metric from one log-softmax.
    logits0, targets = make(seed=2, dtype=dtype)
    upstream = torch.randn(3, 5, generator=torch.Generator().manual_seed(5))  # [N, T]

    logits = logits0.clone().requires_grad_(True)
    lp, ent = token_logprobs_and_entropy(logits, targets, temperature, chunk_size=chunk_size)
    (lp * upstream).sum().backward()

    ref_logits = logits0.clone().requires_grad_(True)
    expected = full_logprobs(ref_logits, targets, temperature)
    (expected * upstream).sum().backward()

    assert not ent.requires_grad  # a metric: no gradient flows through it
    torch.testing.assert_close(lp, expected, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ent, full_entropy(logits0, temperature), atol=1e-5, rtol=0)
    # bf16 logits get bf16 gradients: the two computations may round a value to neighbouring bf16
    # numbers (one ulp is 2^-8 relative), which an upstream drawn from the global RNG once showed.
    if dtype == torch.float32:
        torch.testing.assert_close(logits.grad, ref_logits.grad, atol=1e-6, rtol=0)
    else:
        torch.testing.assert_close(logits.grad, ref_logits.grad, atol=1e-6, rtol=2**-8)


def test_fused_entropy_with_minus_inf_logits_is_finite():
    # logits [0, 0, -inf], target 0 -> log-prob ln 1/2 = -0.693147, entropy ln 2 = 0.693147
    logits = torch.tensor([[[0.0, 0.0, -torch.inf]]], requires_grad=True)
    lp, ent = token_logprobs_and_entropy(logits, torch.tensor([[0]]))
    lp.sum().backward()
    torch.testing.assert_close((lp, ent), (torch.tensor([[-0.693147]]), torch.tensor([[0.693147]])))
    assert torch.isfinite(logits.grad).all()
