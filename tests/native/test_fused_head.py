"""The fused LM head (`backend.fused_lm_head`, `native/fused_head.py`): the LM head inside the
chunked log-softmax gives the log-probs, entropies and gradients of computing the logits first, and no
[N, T, V] tensor is kept for the backward."""

import pytest
import torch
import torch.nn.functional as F

from grpo_run.algo import token_logprobs, token_logprobs_and_entropy
from grpo_run.models.loading import enable_checkpointing
from grpo_run.native.forward import NativeSettings, native_completion_logprobs
from grpo_run.native.fused_head import head_token_logprobs
from tests.native.builders import VOCAB, build, micro_batch


def head_inputs(dtype=torch.float64, n=3, t=5, h=8, v=11):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, t, h, generator=g, dtype=dtype)  # [N, T, H]
    weight = torch.randn(v, h, generator=g, dtype=dtype)  # [V, H]
    targets = torch.randint(0, v, (n, t), generator=g)  # [N, T]
    upstream = torch.randn(n, t, generator=g, dtype=dtype)  # [N, T] a loss with both signs
    return hidden, weight, targets, upstream


@pytest.mark.parametrize("chunk_size", [1, 4, 15, 1000])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_head_logprobs_equal_the_logprobs_of_the_logits(chunk_size, temperature):
    hidden0, weight0, targets, upstream = head_inputs()

    def run(fused: bool):
        hidden, weight = hidden0.clone().requires_grad_(), weight0.clone().requires_grad_()
        if fused:
            lp, ent = head_token_logprobs(hidden, weight, targets, temperature, chunk_size, with_entropy=True)
        else:
            lp, ent = token_logprobs_and_entropy(hidden @ weight.T, targets, temperature, chunk_size)
        (lp * upstream).sum().backward()
        return lp.detach(), ent, hidden.grad, weight.grad

    # float64 throughout: the two orders of the same arithmetic agree to rounding (~1e-15).
    for got, expected in zip(run(True), run(False)):
        torch.testing.assert_close(got, expected, atol=1e-12, rtol=1e-12)


def test_head_logprobs_gradcheck():
    hidden, weight, targets, _ = head_inputs()
    hidden.requires_grad_()
    weight.requires_grad_()
    assert torch.autograd.gradcheck(
        lambda h, w: head_token_logprobs(h, w, targets, 0.8, 4)[0], (hidden, weight)
    )


def test_one_chunk_in_bf16_is_autocasts_lm_head_bit_for_bit():
    # With every row in one chunk and the whole vocabulary in one block, the fused head runs autocast's
    # matmuls on the same shapes: bf16 logits, the gradients rounded to bf16 once and then to float32,
    # as autocast's casts do.
    hidden0, weight0, targets, upstream = head_inputs(torch.float32, n=4, t=6, h=16, v=40)

    def run(fused: bool):
        hidden, weight = hidden0.clone().requires_grad_(), weight0.clone().requires_grad_()
        if fused:
            lp, _ = head_token_logprobs(hidden, weight, targets, 1.0, 1000, dtype=torch.bfloat16)
        else:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = F.linear(hidden, weight)  # [N, T, V] bf16
            lp = token_logprobs(logits, targets, 1.0, chunk_size=1000)
        (lp * upstream).sum().backward()
        return lp.detach(), hidden.grad, weight.grad

    for got, expected in zip(run(True), run(False)):
        assert got.dtype == torch.float32
        assert torch.equal(got, expected)


def saved_for_backward(fn):
    """Shapes of every tensor autograd saves while fn runs."""
    shapes = []

    def pack(t):
        shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, shapes


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("share", [False, True])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_fused_head_equals_logits_first(arch, share, checkpointing):
    """The model's log-probs, entropy metric and every parameter's gradient (the tied LM head's
    included) with and without the fused head, float32; the fused run keeps no [n, T, V] tensor."""
    model = build(arch).train()
    if checkpointing:
        enable_checkpointing(model)
    prompt_ids, prompt_mask, completion_ids = micro_batch()
    n, t = completion_ids.shape

    def run(fused: bool):
        model.zero_grad(set_to_none=True)
        settings = NativeSettings(0.7, 4, backend="native", share_prompts=share, fused_head=fused)
        (lp, ent), saved = saved_for_backward(
            lambda: native_completion_logprobs(
                model, prompt_ids, prompt_mask, completion_ids, settings=settings, with_entropy=True
            )
        )
        (lp * torch.linspace(-1.0, 1.0, lp.numel()).view_as(lp)).sum().backward()
        grads = {name: p.grad.clone() for name, p in model.named_parameters()}
        logit_sized = [s for s in saved if s in ((n, t, VOCAB), (n * t, VOCAB))]  # the logits
        return lp.detach(), ent, grads, logit_sized

    lp, ent, grads, logit_sized = run(True)
    lp0, ent0, grads0, logit_sized0 = run(False)
    torch.testing.assert_close(lp, lp0, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ent, ent0, atol=1e-6, rtol=1e-6)
    for name, grad in grads0.items():
        torch.testing.assert_close(grads[name], grad, atol=1e-6, rtol=1e-5, msg=name)
    assert logit_sized0 and not logit_sized  # the logits-first path keeps [n, T, V]; the fused none


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_fused_head_under_autocast_is_close_to_logits_first(arch):
    """bf16 autocast: the chunks' and blocks' matmuls run on other shapes than the whole head's, which
    rounds differently in bf16, and hidden's gradient is summed over vocabulary blocks."""
    model = build(arch).train()
    prompt_ids, prompt_mask, completion_ids = micro_batch()

    def run(fused: bool):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            lp, _ = native_completion_logprobs(
                model,
                prompt_ids,
                prompt_mask,
                completion_ids,
                settings=NativeSettings(1.0, 4, backend="native", share_prompts=True, fused_head=fused),
            )
        (lp * torch.linspace(-1.0, 1.0, lp.numel()).view_as(lp)).sum().backward()
        return lp.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}

    (lp, grads), (lp0, grads0) = run(True), run(False)
    torch.testing.assert_close(lp, lp0, atol=0.05, rtol=0.02)
    for name, grad in grads0.items():
        scale = grad.abs().max().clamp(min=1e-6)
        assert (grads[name] - grad).abs().max() / scale < 0.05, name


def test_an_entropy_bonus_takes_the_logits_path():
    # The entropy's own gradient needs the logits: with entropy_grad the fused head stands aside and
    # both settings give the same numbers bit for bit.
    model = build("llama").train()
    prompt_ids, prompt_mask, completion_ids = micro_batch()
    kw = dict(with_entropy=True, entropy_grad=True)
    fused, plain = (NativeSettings(1.0, 4, backend="native", fused_head=f) for f in (True, False))
    a = native_completion_logprobs(model, prompt_ids, prompt_mask, completion_ids, settings=fused, **kw)
    b = native_completion_logprobs(model, prompt_ids, prompt_mask, completion_ids, settings=plain, **kw)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert a[1].requires_grad


def test_a_frozen_lm_head_gets_no_weight_gradient():
    # Only the head's input needs a gradient: the weight's is neither computed nor returned, and the
    # input's is the one the trainable head gives.
    hidden0, weight, targets, upstream = head_inputs()
    grads = []
    for trainable in (True, False):
        hidden = hidden0.clone().requires_grad_()
        w = weight.clone().requires_grad_(trainable)
        lp, _ = head_token_logprobs(hidden, w, targets, 1.0, 4)
        (lp * upstream).sum().backward()
        assert (w.grad is not None) == trainable
        grads.append(hidden.grad)
    torch.testing.assert_close(grads[0], grads[1], atol=0, rtol=0)
