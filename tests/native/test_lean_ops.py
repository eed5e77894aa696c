"""The layer's lean steps (native/lean_ops.py) give autograd's outputs and gradients bit for bit and
keep less for the backward."""

import pytest
import torch
import torch.nn.functional as F

from grpo_run.models.loading import enable_checkpointing
from grpo_run.native import lean_ops
from grpo_run.native.lean_ops import attention_core, softmax_rounded, swiglu, swiglu_linear
from grpo_run.native.weight_casts import WeightCasts
from tests.native.builders import accumulated_grads, build


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


def plain_attention_core(q, k, v, keys_ok, heads):
    """The eager attention's steps as autograd records them (native.py before `attention_core`)."""
    n, kv, rows, _ = q.shape
    scores = torch.matmul(q, k.transpose(2, 3)).view(n, heads, rows * kv // heads, k.size(2))
    scores = scores.masked_fill(~keys_ok, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(scores.dtype)
    return torch.matmul(probs.view(n, kv, rows, k.size(2)), v)


def attention_inputs(dtype, *, contiguous: bool):
    """q [2, kv=2, g·t = 2·5, 8] grouped; k, v [2, 2, s=9, 8] as leaves [2, 9, 2, 8] seen transposed,
    like the plain forward's projections (contiguous=False), or as they are, like the shared-prompt
    forward's concatenations; keys_ok [2, 1, 5, 9] with left padding and causal masking."""
    g = torch.Generator().manual_seed(2)
    n, kv, t, s, d = 2, 2, 5, 9, 8
    q = torch.randn(n, kv, 2 * t, d, generator=g).mul(2).to(dtype)
    k, v = (torch.randn(n, s, kv, d, generator=g).to(dtype) for _ in range(2))
    if contiguous:
        k, v = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()
    keys_ok = torch.ones(s, s, dtype=torch.bool).tril()[-t:].expand(n, 1, t, s).clone()
    keys_ok[1, ..., :3] = False  # row 1's prompt has three padding columns
    return q, k, v, keys_ok


@pytest.mark.parametrize("contiguous", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_attention_core_matches_autograd_bit_for_bit_and_keeps_its_inputs_only(dtype, contiguous):
    q, k, v, keys_ok = attention_inputs(dtype, contiguous=contiguous)
    upstream = torch.randn(q.shape, generator=torch.Generator().manual_seed(3)).to(dtype)

    def heads_view(x):  # [n, kv, s, d]
        return x if contiguous else x.transpose(1, 2)

    results = []
    for fn in (plain_attention_core, attention_core):
        a, b, c = leaves(q, k, v)
        out = fn(a, heads_view(b), heads_view(c), keys_ok, 4)
        out.backward(upstream)
        results.append((out.detach(), a.grad, b.grad, c.grad))
    assert "_AttentionCore" in type(out.grad_fn).__name__
    for got, want in zip(results[1], results[0]):
        assert got.dtype == dtype and torch.equal(got, want)
    # The fused step keeps q, k, v and the mask; autograd also keeps the scores (in float32 the
    # probabilities, once) and the rounded probabilities (and, for the transposed k and v, copies).
    scores = 2 * 2 * 5 * 9 * q.element_size()
    kept = q.nbytes + k.nbytes + v.nbytes + keys_ok.nbytes
    saved = {}
    for fn in (plain_attention_core, attention_core):
        a, b, c = leaves(q, k, v)
        saved[fn] = saved_bytes(fn, a, heads_view(b), heads_view(c), keys_ok, 4)
    assert saved[attention_core] == kept
    assert saved[plain_attention_core] >= kept + scores * (1 if dtype == torch.float32 else 2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_swiglu_linear_matches_autograd_bit_for_bit_and_drops_the_products_copy(dtype):
    g = torch.Generator().manual_seed(4)
    gate, up = (torch.randn(3, 5, 64, generator=g).mul(3).to(dtype) for _ in range(2))
    weight = torch.randn(16, 64, generator=g).div(8).to(dtype)
    upstream = torch.randn(3, 5, 16, generator=g).to(dtype)

    def plain(a, b, w):
        return F.linear(F.silu(a) * b, w)

    results = []
    for fn in (plain, swiglu_linear):
        a, b, w = leaves(gate, up, weight)
        out = fn(a, b, w)
        out.backward(upstream)
        results.append((out.detach(), a.grad, b.grad, w.grad))
    for got, want in zip(results[1], results[0]):
        assert got.dtype == dtype and torch.equal(got, want)
    # autograd keeps gate, silu(gate), up and the product (the matmul's input) besides the weight.
    one = gate.nbytes
    assert saved_bytes(plain, *leaves(gate, up, weight)) == 4 * one + weight.nbytes
    assert saved_bytes(swiglu_linear, *leaves(gate, up, weight)) == 2 * one + weight.nbytes


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("share", [False, True])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_a_models_gradients_are_the_same_with_the_lean_steps(monkeypatch, arch, share, checkpointing):
    # The update's forward and backward under bf16 autocast with cast weights (the eager attention,
    # SmolLM2's setting, on the float32 rotary output; the cast down projection): every lean step
    # against autograd's own ops, bit for bit.
    model = build(arch).train()
    model.config._attn_implementation = "eager"
    if checkpointing:
        enable_checkpointing(model)
    monkeypatch.setattr(lean_ops, "LEAN_MIN_ELEMENTS", 2**40)
    expected = accumulated_grads(model, WeightCasts(), share=share)
    monkeypatch.setattr(lean_ops, "LEAN_MIN_ELEMENTS", 0)
    got = accumulated_grads(model, WeightCasts(), share=share)
    for name, grad in expected.items():
        assert torch.equal(got[name], grad), name
