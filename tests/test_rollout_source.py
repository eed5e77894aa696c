"""The trainer side's bookkeeping of rollout=async (grpo_run/rollout_source.py), in worked numbers: which
sent versions a checkpoint needs, which may be written over, and a batch's staleness."""

import pytest

from grpo_run.rollout_source import staleness, unneeded
from grpo_run.rollout_worker import lockstep_version


def test_unneeded_leaves_the_last_max_staleness_plus_one_versions():
    assert unneeded({3, 4}, 5, 1) == [3]  # keeping 5 with k = 1 keeps {4, 5}
    assert unneeded({2, 3, 4}, 5, 1) == [2, 3]
    assert unneeded({4}, 5, 0) == [4]  # k = 0: the last sent version alone
    assert unneeded({3, 4}, 5, 2) == []  # k = 2 keeps {3, 4, 5}
    assert unneeded(set(), 0, 1) == []


@pytest.mark.parametrize("k", [0, 1, 2, 3])
@pytest.mark.parametrize("origin", [0, 5])
def test_a_written_over_version_is_never_one_a_checkpoint_or_a_lockstep_batch_needs(k, origin):
    """Replay the trainer's sends from `origin` on: after each step, the versions left once the unneeded
    ones are dropped hold every version the checkpoint after that step saves for the batches in flight,
    and the one the next batch is sampled with."""
    kept = {origin}
    for step in range(origin + 1, origin + 12):
        for old in unneeded(kept, step, k):
            kept.remove(old)
        kept.add(step)
        in_flight = set(range(lockstep_version(step + 1, origin=origin, max_staleness=k), step))
        assert in_flight <= kept, (step, kept)
        assert lockstep_version(step + 1, origin=origin, max_staleness=k) in kept
        assert len(kept) <= k + 1


def test_staleness_counts_the_steps_between_the_sampling_and_the_trained_weights():
    # Step 7 trains version 6; a batch sampled with version 5 is one step old, with 6 on-policy.
    assert staleness(7, 5) == 1
    assert staleness(7, 6) == 0
    assert lockstep_version(7, origin=0, max_staleness=1) == 5
    assert lockstep_version(2, origin=0, max_staleness=1) == 0  # the start weights until origin + k + 1
