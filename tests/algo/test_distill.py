"""On-policy distillation's math (grpo_run/algo/distill.py): worked numbers with the arithmetic in the
comments, the masks (observation and padding tokens get no teacher term), a loop reference for the
discounted sum, and per-token advantages flowing through every policy loss."""

import pytest
import torch

from grpo_run.algo import (
    POLICY_LOSSES,
    LossInputs,
    LossSettings,
    discounted_future_sum,
    distill_advantages,
    policy_loss,
    teacher_gap,
    teacher_log_ratio,
)

# One completion of three tokens. Student log-probs and the teacher's of the same sampled tokens:
STUDENT = torch.tensor([[-1.0, -2.0, -0.5]])
TEACHER = torch.tensor([[-1.5, -1.0, -0.5]])
ALL = torch.tensor([[1.0, 1.0, 1.0]])
# log pi - log pi_teacher = [-1 + 1.5, -2 + 1, -0.5 + 0.5] = [0.5, -1.0, 0.0]


def test_log_ratio_and_teacher_kl_worked_numbers():
    assert teacher_log_ratio(STUDENT, TEACHER, ALL).tolist() == [[0.5, -1.0, 0.0]]
    gap = teacher_gap(STUDENT, TEACHER, ALL)
    # (0.5 - 1.0 + 0.0) / 3 tokens = -0.5 / 3
    assert (gap.logratio.item(), gap.tokens.item()) == (-0.5, 3.0)


def test_advantage_form_discount_zero_is_each_tokens_own_term():
    adv = distill_advantages(
        torch.tensor([0.7]), STUDENT, TEACHER, ALL, coef=1.0, discount=0.0, reward_weight=0.0
    )
    # A_t = -1 * [0.5, -1.0, 0.0] = [-0.5, 1.0, 0.0]: the task reward's 0.7 is weighted by 0
    assert adv.tolist() == [[-0.5, 1.0, 0.0]]


def test_advantage_form_discount_and_reward_weight_worked_numbers():
    adv = distill_advantages(
        torch.tensor([0.25]), STUDENT, TEACHER, ALL, coef=2.0, discount=0.5, reward_weight=2.0
    )
    # S_2 = 0.0; S_1 = -1.0 + 0.5 * 0.0 = -1.0; S_0 = 0.5 + 0.5 * -1.0 = 0.0
    # A_t = 2.0 * 0.25 - 2.0 * S_t = 0.5 - 2 * [0.0, -1.0, 0.0] = [0.5, 2.5, 0.5]
    assert adv.tolist() == [[0.5, 2.5, 0.5]]


def test_observation_prompt_and_padding_tokens_get_no_teacher_term():
    student = torch.tensor([[-1.0, -3.0, -2.0, -9.0]])
    teacher = torch.tensor([[-2.0, -1.0, -1.0, 5.0]])
    # token 1 is a tool's observation, token 3 padding after EOS: the loss mask holds tokens 0 and 2
    mask = torch.tensor([[1.0, 0.0, 1.0, 0.0]])
    # log-ratios on the mask: token 0: -1 + 2 = 1; token 2: -2 + 1 = -1
    summed = discounted_future_sum(teacher_log_ratio(student, teacher, mask), mask, 0.5)
    # S_2 = -1; S_0 = 1 + 0.5 * S_2 = 0.5 (the observation between them is skipped, not discounted)
    assert summed.tolist() == [[0.5, 0.0, -1.0, 0.0]]
    adv = distill_advantages(
        torch.tensor([3.0]), student, teacher, mask, coef=1.0, discount=0.5, reward_weight=1.0
    )
    # 3 - [0.5, ·, -1.0, ·] = [2.5, 0, 4.0, 0]: off the mask exactly 0, the task advantage too
    assert adv.tolist() == [[2.5, 0.0, 4.0, 0.0]]
    assert teacher_gap(student, teacher, mask).logratio.item() == 0.0  # 1 + (-1)


def test_a_teacher_equal_to_the_student_gives_zero():
    adv = distill_advantages(torch.zeros(1), STUDENT, STUDENT, ALL, coef=3.0, discount=0.9, reward_weight=0.0)
    assert adv.tolist() == [[0.0, 0.0, 0.0]]
    gap = teacher_gap(STUDENT, STUDENT, ALL)
    assert (gap.logratio.item(), gap.kl.item()) == (0.0, 0.0)


def test_discounted_sum_matches_a_loop_reference():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 9, generator=gen, dtype=torch.float64)
    mask = (torch.rand(5, 9, generator=gen) > 0.3).double()
    mask[2] = 0  # an empty row
    got = discounted_future_sum(x, mask, 0.7)
    for i in range(5):
        running = 0.0
        for t in reversed(range(9)):
            if mask[i, t]:
                running = x[i, t].item() + 0.7 * running
                assert got[i, t].item() == pytest.approx(running, abs=1e-12)
            else:
                assert got[i, t].item() == 0.0


@pytest.mark.parametrize("variant", list(POLICY_LOSSES))
def test_per_token_advantages_equal_to_the_rows_give_the_same_loss(variant):
    """A [N, T] advantage whose tokens all hold the row's value is the [N] advantage, in every variant."""
    gen = torch.Generator().manual_seed(1)
    logprobs = -torch.rand(3, 4, generator=gen) - 0.1
    old = logprobs + 0.05 * torch.randn(3, 4, generator=gen)
    mask = torch.tensor([[1.0, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    rows = torch.tensor([0.5, -1.0, 2.0])
    settings = LossSettings(policy_loss=variant)
    by_row = policy_loss(LossInputs(logprobs, old, rows, mask), settings, beta=0.0)
    by_token = policy_loss(LossInputs(logprobs, old, rows[:, None].expand(3, 4), mask), settings, beta=0.0)
    assert by_token.loss.item() == pytest.approx(by_row.loss.item(), rel=1e-6)
    assert by_token.clip_fraction.item() == pytest.approx(by_row.clip_fraction.item())


def test_per_token_advantages_weight_each_token():
    """ratio 1 (pi = pi_old): the clip surrogate is A_t, the per_token loss -mean(A_t) over the mask."""
    logprobs = torch.tensor([[-1.0, -2.0, -0.5]])
    adv = torch.tensor([[-0.5, 1.0, 0.0]])
    out = policy_loss(
        LossInputs(logprobs, logprobs, adv, ALL), LossSettings(aggregation="per_token"), beta=0.0
    )
    # -(-0.5 + 1.0 + 0.0) / 3 = -0.16667
    assert out.loss.item() == pytest.approx(-0.5 / 3)
