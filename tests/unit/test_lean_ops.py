"""The layer's lean steps (models/lean_ops.py) give autograd's outputs and gradients bit for bit and
keep less for the backward."""

import pytest
import torch
import torch.nn.functional as F

from grpo_run.models import lean_ops
from grpo_run.models.lean_ops import softmax_rounded, swiglu


@pytest.fixture(autouse=True)
def lean_at_any_size(monkeypatch):
    monkeypatch.setattr(lean_ops, "LEAN_MIN_ELEMENTS", 0)  # the tests' tensors are small


def saved_bytes(fn, *inputs) -> int:
    """Bytes of the distinct storages autograd keeps for the backward of fn(*inputs)."""
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*inputs)
    return sum(storages.values())


def leaves(*tensors):
    return [t.detach().clone().requires_grad_(True) for t in tensors]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_swiglu_matches_autograd_bit_for_bit_and_keeps_two_tensors(dtype):
    g = torch.Generator().manual_seed(0)
    gate, up = (torch.randn(3, 5, 64, generator=g).mul(3).to(dtype) for _ in range(2))
    upstream = torch.randn(3, 5, 64, generator=g).to(dtype)

    def plain(a, b):
        return F.silu(a) * b

    grads = []
    for fn in (plain, swiglu):
        a, b = leaves(gate, up)
        out = fn(a, b)
        out.backward(upstream)
        grads.append((out.detach(), a.grad, b.grad))
    for got, want in zip(grads[1], grads[0]):
        assert got.dtype == dtype and torch.equal(got, want)
    one = gate.nbytes
    # autograd keeps gate, silu(gate) and up; the fused step keeps gate and up.
    assert saved_bytes(plain, *leaves(gate, up)) == 3 * one
    assert saved_bytes(swiglu, *leaves(gate, up)) == 2 * one


def test_swiglu_without_autograd_is_the_plain_product():
    gate, up = torch.randn(2, 8), torch.randn(2, 8)
    with torch.no_grad():
        assert torch.equal(swiglu(gate, up), F.silu(gate) * up)
    assert swiglu(gate, up).grad_fn is None  # nothing recorded for tensors that need no gradient


def test_softmax_rounded_matches_autograd_bit_for_bit_and_keeps_the_scores_only():
    g = torch.Generator().manual_seed(1)
    scores = torch.randn(2, 3, 7, 11, generator=g).mul(4).bfloat16()
    scores[..., -3:] = torch.finfo(torch.bfloat16).min  # masked keys, as the attention masks them
    upstream = torch.randn(2, 3, 7, 11, generator=g).bfloat16()

    def plain(s):
        return torch.softmax(s, dim=-1, dtype=torch.float32).to(s.dtype)

    results = []
    for fn in (plain, softmax_rounded):
        (s,) = leaves(scores)
        out = fn(s)
        out.backward(upstream)
        results.append((out.detach(), s.grad))
    assert results[1][0].dtype == torch.bfloat16
    assert torch.equal(results[1][0], results[0][0]) and torch.equal(results[1][1], results[0][1])
    # autograd keeps the float32 probabilities (4 bytes an element); this, the bf16 scores (2).
    assert saved_bytes(plain, *leaves(scores)) == 4 * scores.numel()
    assert saved_bytes(softmax_rounded, *leaves(scores)) == 2 * scores.numel()


def test_softmax_rounded_in_float32_is_the_plain_softmax():
    scores = torch.randn(2, 5, requires_grad=True)
    out = softmax_rounded(scores)
    assert torch.equal(out, torch.softmax(scores, dim=-1))
    assert "Softmax" in type(out.grad_fn).__name__  # autograd's own: its output is what it keeps


def test_small_tensors_take_autograds_own_ops(monkeypatch):
    monkeypatch.setattr(lean_ops, "LEAN_MIN_ELEMENTS", 1000)
    gate, up = torch.randn(4, 8, requires_grad=True), torch.randn(4, 8, requires_grad=True)
    assert type(swiglu(gate, up).grad_fn).__name__ == "MulBackward0"  # 32 elements: the plain product
    big = torch.randn(4, 256, requires_grad=True)
    assert type(swiglu(big, big).grad_fn).__name__ == "_SwiGLUBackward"
