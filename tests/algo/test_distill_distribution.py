"""distill.form=distribution's divergence (grpo_run/algo/distill.py) against its oracles: TRL 1.16's own
`GKDTrainer.generalized_jsd_loss` (value and gradient, β ∈ {0, 0.5, 1}, two temperatures), a brute-force
sum over a 7-token vocabulary, the chunked function against whole logits (value and the gradients of the
hidden states and the head), and the advantage form's expected gradient against −∇KL(π‖π_teacher) on a
categorical enumerated exactly."""

import math

import pytest
import torch

from grpo_run.algo import (
    HeadStates,
    distill_advantages,
    distribution_divergence,
    generalized_jsd,
    generalized_jsd_from_logits,
    teacher_gap,
)

BETAS = [0.0, 0.5, 1.0]
TEMPERATURES = [1.0, 0.7]


def trl_jsd():
    pytest.importorskip("trl")
    from trl.experimental.gkd import GKDTrainer

    return GKDTrainer.generalized_jsd_loss


@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_value_and_gradient_equal_trls_generalized_jsd_loss(beta, temperature):
    jsd = trl_jsd()
    gen = torch.Generator().manual_seed(0)
    student = (2 * torch.randn(2, 5, 11, generator=gen, dtype=torch.float64)).requires_grad_()
    teacher = 2 * torch.randn(2, 5, 11, generator=gen, dtype=torch.float64)
    labels = torch.ones(2, 5, dtype=torch.long)
    labels[1, 3:] = -100  # padding: out of TRL's mask and ours
    theirs = jsd(student, teacher, labels=labels, beta=beta, temperature=temperature, reduction="sum")
    (want,) = torch.autograd.grad(theirs, student)
    per_position = generalized_jsd_from_logits(student.double(), teacher, beta=beta, temperature=temperature)
    ours = per_position[labels != -100].sum()
    (got,) = torch.autograd.grad(ours, student)
    torch.testing.assert_close(ours.double(), theirs, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    # batchmean, TRL's default: the sum over its mask's tokens, as our per_token aggregation over the step
    mean = jsd(student, teacher, labels=labels, beta=beta, temperature=temperature)
    torch.testing.assert_close(ours.double() / (labels != -100).sum(), mean, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("beta", BETAS)
def test_a_brute_force_sum_over_seven_tokens(beta):
    s = torch.tensor([0.3, -1.0, 2.0, 0.0, 0.5, -0.2, 1.1], dtype=torch.float64)
    t = torch.tensor([1.0, 0.2, -0.5, 0.4, 0.0, 0.9, -1.3], dtype=torch.float64)
    p = [math.exp(v) / sum(math.exp(u) for u in s.tolist()) for v in s.tolist()]
    q = [math.exp(v) / sum(math.exp(u) for u in t.tolist()) for v in t.tolist()]
    if beta == 0.0:  # forward KL(q || p)
        want = sum(qi * math.log(qi / pi) for pi, qi in zip(p, q))
    elif beta == 1.0:  # reverse KL(p || q)
        want = sum(pi * math.log(pi / qi) for pi, qi in zip(p, q))
    else:  # beta KL(q || m) + (1 - beta) KL(p || m), m = (1 - beta) p + beta q
        m = [(1 - beta) * pi + beta * qi for pi, qi in zip(p, q)]
        want = beta * sum(qi * math.log(qi / mi) for qi, mi in zip(q, m))
        want += (1 - beta) * sum(pi * math.log(pi / mi) for pi, mi in zip(p, m))
    got = generalized_jsd_from_logits(s, t, beta=beta).item()
    assert got == pytest.approx(want, rel=1e-5, abs=1e-7)
    assert got >= 0
    # the chunked function: 7 positions' worth of vocabulary one row at a time, the same number
    eye = torch.eye(7, dtype=torch.float32)

    def head(logits, chunk):  # one position whose logits hidden @ weight.T are `logits`
        return HeadStates(eye[:1], logits.float().unsqueeze(-1) * eye[0], 1.0, torch.float32, chunk)

    one = generalized_jsd(head(s, 1), head(t, 1), beta=beta)  # logits = hidden @ weight.T = s
    assert one.item() == pytest.approx(want, rel=1e-4, abs=1e-6)


def heads(rows=6, hidden=8, vocab_s=37, vocab_t=40, seed=1):
    gen = torch.Generator().manual_seed(seed)
    hs = torch.randn(rows, hidden, generator=gen, dtype=torch.float64).requires_grad_()
    ws = torch.randn(vocab_s, hidden, generator=gen, dtype=torch.float64).requires_grad_()
    ht = torch.randn(rows, hidden + 2, generator=gen, dtype=torch.float64)
    wt = torch.randn(vocab_t, hidden + 2, generator=gen, dtype=torch.float64)
    return hs, ws, ht, wt


@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("temperature", TEMPERATURES)
@pytest.mark.parametrize("chunk", [1, 3, 1000])
def test_chunked_equals_whole_logits_value_and_gradients(beta, temperature, chunk):
    """Vocabulary blocks of 1 to all rows: the same values and gradients w.r.t. the student's hidden
    states and head as autograd through whole logits; heads of 37 and 40 rows compare over 37."""
    hs, ws, ht, wt = heads()
    want = generalized_jsd_from_logits(hs @ ws.T, (ht @ wt.T)[:, :37], beta=beta, temperature=temperature)
    weights = torch.linspace(0.5, 1.5, 6, dtype=torch.float64)
    want_grads = torch.autograd.grad((want * weights).sum(), (hs, ws))
    got = generalized_jsd(
        HeadStates(hs, ws, temperature, torch.float64, chunk),
        HeadStates(ht, wt, temperature, torch.float64, chunk),
        beta=beta,
    )
    got_grads = torch.autograd.grad((got * weights).sum(), (hs, ws))
    torch.testing.assert_close(got.double(), want.double(), rtol=1e-5, atol=1e-7)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("beta", BETAS)
def test_chunked_gradient_equals_trls_through_the_head(beta):
    """TRL's loss on logits = hidden @ weight.T: the gradient w.r.t. the hidden states and the head."""
    jsd = trl_jsd()
    hs, ws, ht, wt = heads(vocab_t=37)
    theirs = jsd(
        (hs @ ws.T).unsqueeze(0), (ht @ wt.T).unsqueeze(0), beta=beta, temperature=0.7, reduction="sum"
    )
    want = torch.autograd.grad(theirs, (hs, ws))
    ours = generalized_jsd(
        HeadStates(hs, ws, 0.7, torch.float64, 2), HeadStates(ht, wt, 0.7, torch.float64, 2), beta=beta
    ).sum()
    got = torch.autograd.grad(ours, (hs, ws))
    torch.testing.assert_close(ours.double(), theirs, rtol=1e-5, atol=1e-7)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-7)


def test_the_per_position_term_is_zero_off_the_mask_and_never_computed_there():
    hs, ws, ht, wt = heads(rows=6)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.float32)
    student = HeadStates(hs.reshape(2, 3, 8), ws, 1.0, torch.float64, 4)
    teacher = HeadStates(ht.reshape(2, 3, 10).clone(), wt, 1.0, torch.float64, 4)
    teacher.hidden[0, 2] = float("nan")  # off the mask: must not spread
    out = distribution_divergence(student, teacher, mask, jsd_beta=1.0)
    assert out.shape == (2, 3) and (out[mask == 0] == 0).all() and (out[mask == 1] > 0).all()
    out.sum().backward()
    assert torch.isfinite(hs.grad).all() and (hs.grad.reshape(2, 3, 8)[mask == 0] == 0).all()


def test_a_teacher_equal_to_the_student_gives_zero_divergence_and_gradient():
    hs, ws, _, _ = heads()
    same = HeadStates(hs, ws, 1.0, torch.float64, 5)
    for beta in BETAS:
        out = generalized_jsd(same, HeadStates(hs.detach(), ws.detach(), 1.0, torch.float64, 5), beta=beta)
        (g,) = torch.autograd.grad(out.sum(), hs)
        assert out.abs().max() < 1e-12 and g.abs().max() < 1e-12


def test_teacher_gap_k1_and_k3_worked_numbers():
    student = torch.tensor([[-1.0, -2.0, -0.5]])
    teacher = torch.tensor([[-1.5, -1.0, -0.5]])
    gap = teacher_gap(student, teacher, torch.ones(1, 3))
    # k1 = [0.5, -1.0, 0.0] summed: -0.5
    # k3 with d = log pi_t - log pi = [-0.5, 1.0, 0]: e^-0.5 + 0.5 - 1 = 0.106531; e - 1 - 1 = 0.718282; 0
    assert gap.logratio.item() == pytest.approx(-0.5)
    assert gap.kl.item() == pytest.approx(0.106531 + 0.718282, abs=1e-5)
    assert gap.tokens.item() == 3


def test_the_advantage_forms_expected_gradient_is_minus_the_reverse_kl_gradient():
    """Seven one-token completions, each sampled with probability π(x) = softmax(θ)(x): the expected
    policy gradient E_π[A(x) ∇ log π(x)] with the advantage form's A = −(log π − log π_t) equals
    −∇ KL(π ‖ π_t), summed exactly over the categorical (coef 1, no discount, no task reward)."""
    theta = torch.tensor([0.3, -1.0, 2.0, 0.0, 0.5, -0.2, 1.1], dtype=torch.float64, requires_grad=True)
    log_t = torch.log_softmax(torch.tensor([1.0, 0.2, -0.5, 0.4, 0.0, 0.9, -1.3], dtype=torch.float64), -1)
    log_pi = torch.log_softmax(theta, -1)  # [7]
    lp = log_pi.unsqueeze(-1)  # [7, 1]: row x is the completion "x"
    adv = distill_advantages(
        torch.zeros(7, dtype=torch.float64),
        lp,
        log_t.unsqueeze(-1),
        torch.ones(7, 1),
        coef=1.0,
        discount=0.0,
        reward_weight=0.0,
    )  # [7, 1] constants
    surrogate = (log_pi.exp().detach() * adv.squeeze(-1) * log_pi).sum()  # Σ_x π(x) A(x) log π(x)
    (expected,) = torch.autograd.grad(surrogate, theta, retain_graph=True)
    kl = (log_pi.exp() * (log_pi - log_t)).sum()
    (grad_kl,) = torch.autograd.grad(kl, theta)
    torch.testing.assert_close(expected, -grad_kl)
