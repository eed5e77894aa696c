"""The checks that keep a run from training silently wrong, fed by hand: the update norm
(grpo_run/safety/update_norm.py), the sample accounting (grpo_run/safety/accounting.py) and the steps a
resume leaves to train (grpo_run/safety/resume_policy.check_steps_left). Their runs on the tiny model:
tests/integration/test_nothing_silently_wrong.py."""

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from grpo_run import metrics as M
from grpo_run.asynchronous.source import uneven_completions
from grpo_run.rollout.groups import Sampled
from grpo_run.safety.accounting import SampleAccountingError, account_samples
from grpo_run.safety.resume_policy import AlreadyTrained, NothingToTrain, ResumeConfigError, check_steps_left
from grpo_run.safety.update_norm import moved_squared, snapshot


def fake_engine(module: torch.nn.Module, rank: int = 0, world_size: int = 1):
    return SimpleNamespace(module=module, rank=rank, world_size=world_size)


def model(dtype=torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2)).to(dtype)
    m[1].bias.requires_grad_(False)  # frozen: never copied, never counted
    return m


def norm_of_change(m: torch.nn.Module, change) -> tuple[float, float]:
    """(moved_squared's norm, the norm of theta_after - theta_before computed directly in float64)."""
    before = snapshot(fake_engine(m))
    old = [p.detach().double().clone() for p in m.parameters() if p.requires_grad]
    with torch.no_grad():
        change(m)
    direct = sum(
        (p.detach().double() - o).square().sum()
        for p, o in zip([p for p in m.parameters() if p.requires_grad], old)
    )
    return float(moved_squared(before, torch.device("cpu")).sqrt()), float(direct.sqrt())


def test_the_update_norm_is_the_norm_of_the_change_over_the_trainable_parameters():
    m = model()
    got, want = norm_of_change(m, lambda m: [p.add_(0.01 * torch.randn_like(p)) for p in m.parameters()])
    assert got == pytest.approx(want, rel=1e-6) and want > 0
    # The frozen bias moved too, but it is not trainable: only what the optimizer owns counts.
    got, want = norm_of_change(m, lambda m: m[1].bias.add_(1.0))
    assert got == want == 0.0


def test_the_update_norm_is_exactly_zero_only_when_nothing_moved():
    m = model()
    assert norm_of_change(m, lambda m: None) == (0.0, 0.0)
    # One element moved by one unit in the last place: its squares underflow float32 (1e-45 ** 2), yet
    # the norm says it moved, and by how much.
    tiny = torch.finfo(torch.float32).tiny

    def one_ulp(m):
        w = m[0].weight
        w[0, 0] = torch.nextafter(w[0, 0], torch.tensor(1.0))

    got, want = norm_of_change(m, one_ulp)
    assert got > 0 and got == pytest.approx(want, rel=1e-6)
    m[0].weight.data[1, 1] = 0.0

    def subnormal(m):
        m[0].weight[1, 1] = tiny / 8  # a subnormal change of a weight at 0

    got, want = norm_of_change(m, subnormal)
    assert got > 0 and got == pytest.approx(want, rel=1e-6)


def test_the_update_norm_in_bf16_and_without_overflow():
    m = model(torch.bfloat16)
    got, want = norm_of_change(m, lambda m: [p.add_(torch.full_like(p, 3.0e19)) for p in m.parameters()])
    assert want > 1e19 and got == pytest.approx(want, rel=1e-2)  # float32 squares of 3e19 would overflow


def test_ranks_copy_disjoint_shares_that_cover_every_trainable_tensor():
    m = model()
    trainable = [p for p in m.parameters() if p.requires_grad]
    shares = [snapshot(fake_engine(m, rank=r, world_size=2)) for r in range(2)]
    owned = [id(p) for share in shares for p, _ in share]
    assert sorted(owned) == sorted(id(p) for p in trainable) and len(set(owned)) == len(owned)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.5)
    total = sum(moved_squared(share, torch.device("cpu")) for share in shares)  # the all-reduce sum
    assert float(total.sqrt()) == pytest.approx(0.5 * sum(p.numel() for p in trainable) ** 0.5, rel=1e-6)


def counts(scored, trained, **dropped) -> dict[str, float]:
    names = {"zero_std": M.DROPPED_ZERO_STD, "surplus": M.DROPPED_SURPLUS, "masked": M.DROPPED_MASKED}
    return {M.SCORED_COMPLETIONS: scored, M.TRAINED_COMPLETIONS: trained} | {
        names[k]: v for k, v in dropped.items()
    }


def test_accounting_fills_the_absent_counts_and_stops_a_step_that_lost_completions():
    m = counts(16.0, 10.0, zero_std=4.0, masked=2.0)
    account_samples(3, m)
    assert m[M.DROPPED_STALE] == 0.0 and m[M.DROPPED_RANK_BALANCE] == 0.0  # logged every step
    # groups None (dynamic sampling kept nothing): no trained count was logged, everything dropped
    account_samples(4, counts(8.0, 0.0, zero_std=8.0) | {M.TRAINED_COMPLETIONS: 0.0})
    with pytest.raises(SampleAccountingError) as err:
        account_samples(5, counts(16.0, 8.0, zero_std=4.0))
    line = str(err.value)
    assert "step 5: 16 completions were scored, 8 trained and 4 counted as dropped" in line
    assert "4 unaccounted for" in line and "train/dropped/zero_std=4" in line and "\n" not in line


def test_the_completions_cut_to_split_an_async_batch_over_the_ranks_are_counted():
    def sampled(groups: int | None) -> Sampled:
        kept = (
            None if groups is None else SimpleNamespace(examples=[0] * groups, rewards=torch.zeros(groups, 4))
        )
        return Sampled(kept, None, 0.0, torch.zeros(()))

    assert uneven_completions(sampled(None), 2) == 0
    assert uneven_completions(sampled(4), 2) == 0
    assert uneven_completions(sampled(3), 2) == 4  # one group of 4 left out
    assert uneven_completions(sampled(1), 2) == 4  # fewer groups than ranks: no rank trains


def test_a_resume_leaves_steps_to_train_or_says_why_not():
    folder = Path("/runs/x/checkpoints/step_00000008")
    check_steps_left(9, folder, 8)  # one step left: trains
    with pytest.raises(AlreadyTrained, match="is at step 8, trainer.max_steps=8: the run is already trained"):
        check_steps_left(8, folder, 8)
    with pytest.raises(NothingToTrain) as err:
        check_steps_left(5, folder, 8)
    assert isinstance(err.value, ResumeConfigError)  # exit 2, like every config error
    assert str(err.value) == (
        f"resume: the checkpoint {folder} is at step 8, trainer.max_steps=5: nothing to train; raise "
        "trainer.max_steps above 8 to continue (a checkpoint is never trained backwards)"
    )
