"""The trainer side's bookkeeping of rollout=async (grpo_run/rollout_source.py), in worked numbers: which
sent versions a checkpoint needs, which may be written over, a batch's staleness, and when the update
borrows the worker's threads (rollout.lend_threads)."""

import queue
import threading
from types import SimpleNamespace

import pytest
import torch

from grpo_run.rollout_source import (
    AsyncRollouts,
    RolloutWorkerError,
    lends_threads,
    lent_from,
    staleness,
    unneeded,
    worker_blocked,
)
from grpo_run.rollout_worker import BUSY, DONE, lockstep_version


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


def test_the_worker_lends_the_second_half_of_the_micro_batches():
    assert [lent_from(n) for n in (1, 2, 3, 4, 5)] == [None, 1, 1, 2, 2]


def lending_cfg(**rollout):
    r = {"lend_threads": True, "lockstep": True, "max_staleness": 1, **rollout}
    return SimpleNamespace(rollout=SimpleNamespace(**r))


CPU, GPU = torch.device("cpu"), torch.device("cuda", 0)


@pytest.mark.parametrize(
    ("rollout", "devices", "alone", "lends"),
    [
        ({}, (CPU, CPU), set(), True),
        ({}, (CPU, CPU), {4}, False),  # the update would wait through the worker's own evaluation
        ({"lend_threads": False}, (CPU, CPU), set(), False),
        ({"max_staleness": 0}, (CPU, CPU), set(), False),  # the synchronous loop's numbers, on its threads
        ({"max_staleness": 2}, (CPU, CPU), set(), True),
        ({"lockstep": False}, (CPU, CPU), set(), False),
        ({}, (GPU, CPU), set(), False),
        ({}, (CPU, GPU), set(), False),
    ],
)
def test_which_runs_lend_the_workers_threads(rollout, devices, alone, lends):
    assert lends_threads(lending_cfg(**rollout), *devices, alone) is lends


def lender(waiting: int, *, last_sent: int = 4, alive: bool = True) -> AsyncRollouts:
    """An AsyncRollouts as far as `borrowed_threads` reads it: its worker says it waits holding `waiting`,
    and the trainer has sent versions up to `last_sent`."""
    src = AsyncRollouts.__new__(AsyncRollouts)
    src.cfg = SimpleNamespace(rollout=SimpleNamespace(timeout_s=60.0, threads=3))
    src.lends, src.lent, src.lend_wait_s, src.last_sent = True, 0, 0.0, last_sent
    src.waiting = SimpleNamespace(value=waiting)
    src.process = SimpleNamespace(is_alive=lambda: alive, pid=123, exitcode=1, join=lambda timeout: None)
    src.evals, src.queue = queue.Queue(), queue.Queue()
    return src


def test_the_worker_is_blocked_once_it_holds_the_newest_weights_sent():
    assert worker_blocked(4, 4)  # holds version 4, the newest sent: it waits for step 5's
    assert worker_blocked(3, 3)  # lockstep sent nothing after 3 (the last steps sample nothing)
    assert not worker_blocked(3, 4)  # version 4 is on its way: it samples again
    assert not worker_blocked(BUSY, 0)
    assert worker_blocked(DONE, 31)


def test_an_update_borrows_only_once_the_worker_is_blocked():
    """Step 5, after version 4 was sent. A worker holding version 3 is about to take 4 and sample again:
    the update waits at its second half, and borrows the worker's 3 threads once it holds 4."""
    src = lender(waiting=3, last_sent=4)
    assert src.borrowed_threads(5, 0, 2) == 0  # the first half: never lent, never waits
    assert src.borrowed_threads(5, 0, 1) == 0  # one micro-batch: nothing to lend to
    got = []
    t = threading.Thread(target=lambda: got.append(src.borrowed_threads(5, 1, 2)))
    t.start()
    t.join(timeout=0.3)
    assert t.is_alive() and got == []  # still waiting: the worker has not said it holds version 4
    src.waiting.value = 4
    t.join(timeout=10)
    assert got == [3] and src.lent == 3
    assert lender(waiting=DONE).borrowed_threads(5, 1, 2) == 3  # a worker with nothing left to make


def test_a_worker_that_dies_while_the_update_waits_to_borrow_ends_the_run():
    with pytest.raises(RolloutWorkerError, match="died while generating"):
        lender(waiting=BUSY, alive=False).borrowed_threads(5, 1, 2)
