"""On-policy distillation: a teacher scores the student's own sampled completions (docs/algorithm.md).

Shapes: N completions, T completion positions, H a model's hidden size, V its head's rows. `logprobs`
is log pi_student and `teacher_logprobs` log pi_teacher of the same sampled token at each position, both
[N, T]; `mask` [N, T] holds the loss tokens (the model's own tokens: prompt, padding and a multi-turn
episode's observation tokens are 0). Values off the mask never reach a result.

The forms are one table, `DISTILL_FORMS` (as `POLICY_LOSSES` is for the policy loss): each entry names
the knobs it reads, whether it needs the teacher's full next-token distribution, how the advantage the
policy loss reads is made, the loss term it adds (if any), its checks and its metrics.
- advantage: A_t = reward_weight * A_i - coef * sum_{s >= t} discount^k(s) (log pi_s - log pi_teacher_s),
  the sum over the completion's loss tokens from t on, k(s) counting the loss tokens between t and s
  (discount 0: the token's own term only). The policy-gradient loss then pushes each token by it; only
  the sampled token's log-prob is compared, so the two vocabularies may differ in padding.
- distribution: coef * the aggregated exact divergence between the student's and the teacher's full
  next-token distributions at each loss position (the generalized JSD of on-policy GKD, `jsd_beta`: 0
  forward KL(teacher || student), 1 reverse KL(student || teacher), between the generalized JSD), added
  to the policy loss, whose advantage is the group-relative one times reward_weight. Computed from the
  models' final hidden states and LM heads in vocabulary blocks (`generalized_jsd`): no [N, T, V]
  logits of either model exist.
"""

import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from grpo_run.algo.enums import DistillForm
from grpo_run.algo.kl import kl_k3
from grpo_run.algo.losses import KnobProblem


def teacher_log_ratio(
    logprobs: torch.Tensor, teacher_logprobs: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """log pi_student - log pi_teacher of each loss token, 0 off the mask. [N, T] -> [N, T]."""
    on = mask != 0  # [N, T]
    return torch.where(on, logprobs - teacher_logprobs, torch.zeros_like(logprobs))  # [N, T]


def discounted_future_sum(x: torch.Tensor, mask: torch.Tensor, discount: float) -> torch.Tensor:
    """S_t = x_t + discount * S_next on loss tokens, S_next the value at the next loss token (0 past the
    last); 0 off the mask. Observation tokens between two model turns are skipped, not discounted.
    x, mask: [N, T] -> [N, T]."""
    on = mask != 0  # [N, T]
    x = torch.where(on, x, torch.zeros_like(x))  # [N, T]
    if discount == 0:
        return x
    out = torch.zeros_like(x)  # [N, T]
    running = torch.zeros_like(x[:, 0])  # [N] the sum from the next loss token on
    for t in range(x.size(1) - 1, -1, -1):
        running = torch.where(on[:, t], x[:, t] + discount * running, running)  # [N]
        out[:, t] = torch.where(on[:, t], running, torch.zeros_like(running))
    return out


def distill_advantages(
    advantages: torch.Tensor,
    logprobs: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    coef: float,
    discount: float,
    reward_weight: float,
) -> torch.Tensor:
    """Per-token advantages [N, T] of distill.form=advantage: reward_weight times the group-relative
    advantage `advantages` [N] broadcast over the row, minus coef times the discounted sum of the teacher
    log-ratios from each token on (module docstring); 0 off the mask. `logprobs` are the student's
    without gradient (the advantage is a constant of the loss)."""
    ratio = teacher_log_ratio(logprobs.detach(), teacher_logprobs, mask)  # [N, T]
    teacher_term = -coef * discounted_future_sum(ratio, mask, discount)  # [N, T]
    task_term = reward_weight * advantages.to(ratio.dtype).unsqueeze(-1)  # [N, 1]
    on = mask != 0  # [N, T]
    return torch.where(on, task_term + teacher_term, torch.zeros_like(teacher_term))  # [N, T]


class TeacherGap(NamedTuple):
    """Sums over the loss tokens of the sampled-token gap to the teacher, for the step's means."""

    logratio: torch.Tensor  # [] sum of k1 = log pi_student - log pi_teacher (either sign)
    kl: torch.Tensor  # [] sum of k3 = exp(d) - d - 1, d = log pi_teacher - log pi_student (>= 0)
    tokens: torch.Tensor  # [] loss tokens


def teacher_gap(logprobs: torch.Tensor, teacher_logprobs: torch.Tensor, mask: torch.Tensor) -> TeacherGap:
    """distill/teacher_logratio (k1) and distill/teacher_kl (k3, the non-negative estimate of
    KL(pi_student || pi_teacher) from the student's samples) as sums over the loss tokens. [N, T] -> []."""
    ratio = teacher_log_ratio(logprobs.detach(), teacher_logprobs, mask)  # [N, T], 0 off the mask
    k3 = kl_k3(torch.zeros_like(ratio), -ratio)  # [N, T] exp(-r) + r - 1, 0 where r = 0 (off the mask)
    return TeacherGap(ratio.sum(), k3.sum(), (mask != 0).sum().to(ratio.dtype))


# ---------------------------------------------------------------------------------------------------------
# The exact divergence of full next-token distributions, from the LM heads' inputs.


def _check_beta(beta: float) -> None:
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"jsd_beta must lie in [0, 1], got {beta}")


def _pointwise(lp: torch.Tensor, lq: torch.Tensor, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(f, pg) per vocabulary entry from the student's log-probs lp and the teacher's lq [..., V] float:
    f sums over V to the divergence; pg = p * dJ/dp, whose sum c gives dJ/ds = pg - p c (s the student's
    scaled logits). beta 0: KL(q || p), f = q (lq - lp), pg = -q. beta 1: KL(p || q), f = p (lp - lq),
    pg = p (lp - lq + 1). Between: m = (1 - beta) p + beta q, f = beta q (lq - lm) + (1 - beta) p (lp - lm),
    pg = (1 - beta) p (lp - lm) (the mixture's own dependence on p cancels)."""
    p, q = lp.exp(), lq.exp()
    if beta == 0.0:
        return q * (lq - lp), -q
    if beta == 1.0:
        return p * (lp - lq), p * (lp - lq + 1.0)
    lm = torch.logaddexp(lp + math.log1p(-beta), lq + math.log(beta))  # [..., V] log of the mixture
    student = (1.0 - beta) * p * (lp - lm)
    return beta * q * (lq - lm) + student, student


def generalized_jsd_from_logits(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, *, beta: float, temperature: float = 1.0
) -> torch.Tensor:
    """The divergence at each position from whole logits [..., V] (both at `temperature`): the reference
    `generalized_jsd` is checked against, with autograd's gradient. [..., V] -> [...] float32 (float64
    stays float64)."""
    _check_beta(beta)
    s = student_logits.to(torch.promote_types(student_logits.dtype, torch.float32)) / temperature
    t = teacher_logits.to(s.dtype) / temperature
    lp, lq = torch.log_softmax(s, dim=-1), torch.log_softmax(t, dim=-1)  # [..., V]
    return _pointwise(lp, lq, beta)[0].sum(-1)  # [...]


class HeadStates(NamedTuple):
    """A model's next-token distributions at some positions, as the LM head's input and weight: the
    logits are (hidden @ weight.T) / temperature, the matmul in `dtype`. `chunk_size`: how many rows of
    the full vocabulary one block of `generalized_jsd` may hold (rows x V floats per block)."""

    hidden: torch.Tensor  # [..., H] the final (normed) hidden states
    weight: torch.Tensor  # [V, H] the LM head's weight (no bias)
    temperature: float
    dtype: torch.dtype
    chunk_size: int


def _block_logits(hidden: torch.Tensor, weight: torch.Tensor, cols: slice, dtype, temperature):
    """Scaled logits [K, Vb] of vocabulary rows `cols`, float32 (float64 stays float64)."""
    logits = torch.matmul(hidden.to(dtype), weight[cols].to(dtype).T)
    return logits.to(torch.promote_types(dtype, torch.float32)) / temperature


class _GeneralizedJSD(torch.autograd.Function):
    """Per-position divergence [K] of the student's logits hs @ ws.T against the teacher's ht @ wt.T over
    the first `vocab` rows of both heads, walking the vocabulary in blocks of `width` rows. The forward
    takes two passes (both normalisers by an online logsumexp; then the divergence and c = sum_v p_v g_v),
    the backward one (each block's logits again, dJ/ds = p (g - c), into the student's hidden state and
    head). The teacher's side has no gradient."""

    @staticmethod
    def forward(ctx, hs, ws, ht, wt, beta, temperature, vocab, width, dtype_s, dtype_t):
        rows, device = hs.shape[0], hs.device
        fdt = torch.promote_types(dtype_s, torch.float32)  # the arithmetic's dtype
        blocks = [slice(a, min(a + width, vocab)) for a in range(0, vocab, width)]
        with torch.autocast(device.type, enabled=False):  # dtypes are explicit here
            lse = []
            for h, w, dtype in ((hs, ws, dtype_s), (ht, wt, dtype_t)):
                peak = torch.full((rows,), -torch.inf, dtype=fdt, device=device)  # [K]
                total = torch.zeros(rows, dtype=fdt, device=device)  # [K]
                for cols in blocks:
                    x = _block_logits(h, w, cols, dtype, temperature)  # [K, Vb]
                    new = torch.maximum(peak, x.max(-1).values)  # [K]
                    total = total * (peak - new).exp() + (x - new.unsqueeze(-1)).exp().sum(-1)
                    peak = new
                lse.append(peak + total.log())  # [K]
            value, c = (
                torch.zeros(rows, dtype=fdt, device=device),
                torch.zeros(rows, dtype=fdt, device=device),
            )
            for cols in blocks:
                lp = _block_logits(hs, ws, cols, dtype_s, temperature) - lse[0].unsqueeze(-1)  # [K, Vb]
                lq = _block_logits(ht, wt, cols, dtype_t, temperature) - lse[1].unsqueeze(-1)  # [K, Vb]
                f, pg = _pointwise(lp, lq, beta)
                value += f.sum(-1)
                c += pg.sum(-1)
        ctx.save_for_backward(hs, ws, ht, wt, lse[0], lse[1], c)
        ctx.settings = (beta, temperature, blocks, dtype_s, dtype_t)
        return value

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        hs, ws, ht, wt, lse_s, lse_t, c = ctx.saved_tensors
        beta, temperature, blocks, dtype_s, dtype_t = ctx.settings
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        fdt = c.dtype
        grad_hidden = torch.zeros(hs.shape, dtype=fdt, device=hs.device) if need_hidden else None
        grad_weight = torch.zeros(ws.shape, dtype=fdt, device=ws.device) if need_weight else None
        scale = (grad_out.to(fdt) / temperature).unsqueeze(-1)  # [K, 1] ds/dlogits = 1 / temperature
        with torch.autocast(hs.device.type, enabled=False):
            for cols in blocks:
                lp = _block_logits(hs, ws, cols, dtype_s, temperature) - lse_s.unsqueeze(-1)  # [K, Vb]
                lq = _block_logits(ht, wt, cols, dtype_t, temperature) - lse_t.unsqueeze(-1)  # [K, Vb]
                pg = _pointwise(lp, lq, beta)[1]
                g = (pg - lp.exp() * c.unsqueeze(-1)) * scale  # [K, Vb] dJ/dlogits
                if need_hidden:
                    grad_hidden += g @ ws[cols].to(fdt)  # [K, H]
                if need_weight:
                    grad_weight[cols] = g.T @ hs.to(fdt)  # [Vb, H]
        return (
            None if grad_hidden is None else grad_hidden.to(hs.dtype),
            None if grad_weight is None else grad_weight.to(ws.dtype),
            *([None] * 8),
        )


def generalized_jsd(student: HeadStates, teacher: HeadStates, *, beta: float) -> torch.Tensor:
    """The divergence (`generalized_jsd_from_logits`) at each of K positions, from the heads' inputs
    student.hidden [K, H] and teacher.hidden [K, H_t] (any leading shape, the same for both): no [K, V]
    logits exist whole, only blocks of about chunk_size x V floats (each model's logits at a time, two
    of them in the forward's second pass and the backward). Heads padded to different sizes are compared
    over the shorter one's rows (the tokenizer's real vocabulary lies inside both). Gradient w.r.t. the
    student's hidden states and head weight; the teacher is a constant. [K] float32 (float64 for
    float64 matmuls)."""
    _check_beta(beta)
    if student.temperature != teacher.temperature:
        raise ValueError(f"temperatures differ: {student.temperature} vs {teacher.temperature}")
    if student.hidden.shape[:-1] != teacher.hidden.shape[:-1]:
        raise ValueError(f"positions differ: {tuple(student.hidden.shape)} vs {tuple(teacher.hidden.shape)}")
    shape = student.hidden.shape[:-1]  # the positions, any leading shape
    hs = student.hidden.reshape(-1, student.hidden.shape[-1])  # [K, H]
    ht = teacher.hidden.detach().to(hs.device).reshape(-1, teacher.hidden.shape[-1])  # [K, H_t]
    rows = hs.shape[0]
    if rows == 0:
        return hs.new_zeros(shape, dtype=torch.promote_types(student.dtype, torch.float32))
    vocab = min(student.weight.shape[0], teacher.weight.shape[0])
    width = max(1, min(vocab, student.chunk_size * vocab // rows))  # rows x width ~ chunk_size x V
    out = _GeneralizedJSD.apply(
        hs,
        student.weight,
        ht,
        teacher.weight.detach().to(hs.device),
        beta,
        student.temperature,
        vocab,
        width,
        student.dtype,
        teacher.dtype,
    )  # [K]
    return out.reshape(shape)


def distribution_divergence(
    student: HeadStates, teacher: HeadStates, mask: torch.Tensor, *, jsd_beta: float
) -> torch.Tensor:
    """distill.form=distribution's per-position term [N, T] before its coefficient: the divergence of the
    student's and the teacher's full distributions at each loss position (states [N, T, H]), 0 off the
    mask (those positions are never computed)."""
    on = mask != 0  # [N, T]
    kept = generalized_jsd(
        student._replace(hidden=student.hidden[on]),
        teacher._replace(hidden=teacher.hidden[on]),
        beta=jsd_beta,
    )  # [K]
    return torch.zeros(mask.shape, dtype=kept.dtype, device=mask.device).masked_scatter(on, kept)  # [N, T]


# ---------------------------------------------------------------------------------------------------------
# The table of forms.

# (the distill knobs by name, as the config holds them; whether this form is the one chosen) -> problems.
FormCheck = Callable[[Mapping[str, Any], bool], Iterator[KnobProblem]]
# (group-relative advantages [N], student log-probs [N, T], teacher log-probs [N, T], mask, **knobs)
# -> the advantages the policy loss reads ([N] or [N, T]).
AdvantageHook = Callable[..., torch.Tensor]
# (student states [n, T, H], teacher states [n, T, H_t], mask [n, T], **knobs) -> per-position term [n, T].
LossHook = Callable[..., torch.Tensor]


def _no_checks(knobs: Mapping[str, Any], chosen: bool) -> Iterator[KnobProblem]:
    return iter(())


def _advantage_checks(knobs: Mapping[str, Any], chosen: bool) -> Iterator[KnobProblem]:
    if chosen and knobs["off_policy_mask_threshold"] is not None:
        yield KnobProblem(
            "grpo.off_policy_mask_threshold",
            knobs["off_policy_mask_threshold"],
            "the off-policy mask drops whole completions by the sign of their advantage, which distillation "
            "makes per token; use distill.form=distribution",
            "distill.form",
            DistillForm.ADVANTAGE.value,
        )


def _distribution_checks(knobs: Mapping[str, Any], chosen: bool) -> Iterator[KnobProblem]:
    beta = knobs["jsd_beta"]
    if chosen and not (isinstance(beta, (int, float)) and 0.0 <= beta <= 1.0):
        yield KnobProblem(
            "distill.jsd_beta", beta, "must lie in [0, 1] (0: forward KL, 1: reverse KL, between: the JSD)"
        )


def _scaled_task_advantage(advantages, logprobs, teacher_logprobs, mask, *, reward_weight, **_):
    """The group-relative advantage times reward_weight [N]: the teacher enters through the loss term."""
    return reward_weight * advantages


def _advantage_hook(advantages, logprobs, teacher_logprobs, mask, *, coef, discount, reward_weight, **_):
    return distill_advantages(
        advantages,
        logprobs,
        teacher_logprobs,
        mask,
        coef=coef,
        discount=discount,
        reward_weight=reward_weight,
    )


def _distribution_hook(student, teacher, mask, *, jsd_beta, **_):
    return distribution_divergence(student, teacher, mask, jsd_beta=jsd_beta)


@dataclass(frozen=True)
class DistillFormSpec:
    """One distill.form: what the teacher gives, the advantage it makes, the loss term it adds, the knobs
    it alone reads (refused when set under another form), its checks and the metrics it adds."""

    advantages: AdvantageHook
    # The teacher's final hidden states and LM head, not only its sampled-token log-probs.
    teacher_states: bool = False
    loss_term: LossHook | None = None  # per-position term, aggregated like the policy loss, times coef
    knobs: tuple[str, ...] = ()  # DistillConfig fields only this form reads
    check: FormCheck = _no_checks
    metrics: tuple[str, ...] = field(default=())  # metric keys (metrics.py) it adds


DISTILL_FORMS: dict[DistillForm, DistillFormSpec] = {
    DistillForm.ADVANTAGE: DistillFormSpec(_advantage_hook, knobs=("discount",), check=_advantage_checks),
    DistillForm.DISTRIBUTION: DistillFormSpec(
        _scaled_task_advantage,
        teacher_states=True,
        loss_term=_distribution_hook,
        knobs=("jsd_beta",),
        check=_distribution_checks,
        metrics=("distill/divergence",),
    ),
}

# Knobs every form reads.
SHARED_KNOBS = ("coef", "reward_weight")


def form_knobs(form: DistillForm | str) -> tuple[str, ...]:
    """The DistillConfig fields a form's hooks read, by name."""
    return SHARED_KNOBS + DISTILL_FORMS[DistillForm(form)].knobs


def form_problems(knobs: Mapping[str, Any], defaults: Mapping[str, Any]) -> Iterator[KnobProblem]:
    """The problems of the distill knobs (`knobs` by DistillConfig name, plus off_policy_mask_threshold):
    a knob only another form reads, set away from its default (`defaults`), then each form's checks."""
    chosen = DistillForm(knobs["form"])
    reads = form_knobs(chosen)
    for name, spec in DISTILL_FORMS.items():
        for key in spec.knobs:
            if key not in reads and knobs[key] != defaults[key]:
                owner = f"distill.form={name.value}"
                yield KnobProblem(
                    f"distill.{key}",
                    knobs[key],
                    f"only {owner} reads it",
                    "distill.form",
                    chosen.value,
                )
        yield from spec.check(knobs, name is chosen)
