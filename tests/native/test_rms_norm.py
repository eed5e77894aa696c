"""The RMSNorm with a closed-form backward equals F.rms_norm forward and autograd's gradients."""

import math

import pytest
import torch
import torch.nn.functional as F

from grpo_run.native.rms_norm import _RMSNorm, rms_norm


def test_worked_numbers():
    # x = [3, 4], w = [1, 2], eps = 0: mean(x²) = (9 + 16) / 2 = 12.5, r = 12.5^-1/2 = 0.282843
    # y = w·x·r = [0.848528, 2.262742]
    # dy = [1, 1]: g = dy·w = [1, 2]; mean(g·x) = (3 + 8) / 2 = 5.5; r³ = 0.0226274
    # dx = r·g − x·r³·5.5 = [0.282843 − 0.373352, 0.565685 − 0.497803] = [−0.090510, 0.067882]
    # dw = dy·x·r = [0.848528, 1.131371]
    x = torch.tensor([[3.0, 4.0]], requires_grad=True)
    w = torch.tensor([1.0, 2.0], requires_grad=True)
    y = rms_norm(x, w, 0.0)
    y.sum().backward()
    r = 1 / math.sqrt(12.5)
    assert y.detach().tolist()[0] == pytest.approx([3 * r, 8 * r], rel=1e-6)
    assert x.grad.tolist()[0] == pytest.approx([r - 3 * 5.5 * r**3, 2 * r - 4 * 5.5 * r**3], rel=1e-5)
    assert x.grad.tolist()[0] == pytest.approx([-0.090510, 0.067882], abs=1e-6)
    assert w.grad.tolist() == pytest.approx([0.848528, 1.131371], rel=1e-6)


@pytest.mark.parametrize("shape", [(2, 5, 16), (2, 5, 3, 8), (7, 48)])
def test_equals_f_rms_norm_and_its_autograd(shape):
    torch.manual_seed(0)
    x0, w0, dy = torch.randn(shape), torch.randn(shape[-1]), torch.randn(shape)
    grads = []
    for fn in (lambda x, w: F.rms_norm(x, (shape[-1],), w, 1e-6), lambda x, w: rms_norm(x, w, 1e-6)):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        y = fn(x, w)
        y.backward(dy)
        grads.append((y.detach(), x.grad, w.grad))
    (y_ref, dx_ref, dw_ref), (y, dx, dw) = grads
    assert torch.equal(y, y_ref)  # the same ops in the same order: bit for bit
    torch.testing.assert_close(dx, dx_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dw, dw_ref, rtol=1e-5, atol=1e-5)


def test_gradcheck_float64():
    x = torch.randn(3, 4, 6, dtype=torch.float64, requires_grad=True)
    w = torch.randn(6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: _RMSNorm.apply(a, b, 1e-5), (x, w))


def test_one_input_frozen():
    x, w = torch.randn(4, 8, requires_grad=True), torch.randn(8)  # a frozen norm weight
    rms_norm(x, w, 1e-6).sum().backward()
    ref = x.detach().clone().requires_grad_()
    F.rms_norm(ref, (8,), w, 1e-6).sum().backward()
    torch.testing.assert_close(x.grad, ref.grad, rtol=1e-5, atol=1e-6)


def test_falls_back_outside_float32_training():
    x, w = torch.randn(2, 3, 8), torch.randn(8)
    with torch.no_grad():
        assert torch.equal(rms_norm(x.requires_grad_(), w, 1e-6), F.rms_norm(x, (8,), w, 1e-6))
    xb = torch.randn(2, 3, 8, dtype=torch.bfloat16, requires_grad=True)
    y = rms_norm(xb, w.requires_grad_(), 1e-6)
    assert y.grad_fn.name() != "_RMSNormBackward"  # mixed dtypes keep F.rms_norm's own rounding
    assert torch.equal(y, F.rms_norm(xb, (8,), w, 1e-6))
