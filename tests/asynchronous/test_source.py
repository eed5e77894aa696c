"""The trainer side of rollout=async (grpo_run/asynchronous/source.py), in worked numbers: a batch's
staleness, the lockstep rule, and a worker that dies or goes silent while the trainer waits."""

import queue
import threading
from types import SimpleNamespace

import pytest

from grpo_run.asynchronous.source import AsyncRollouts, RolloutWorkerError, staleness
from grpo_run.asynchronous.worker import WorkerFailed, lockstep_version
from grpo_run.rollout.source import RolloutSourceError
from grpo_run.safety.stop import StopRequested, request_stop, share


def test_staleness_counts_the_steps_between_the_sampling_and_the_trained_weights():
    # Step 7 trains version 6; a batch sampled with version 5 is one step old, with 6 on-policy.
    assert staleness(7, 5) == 1
    assert staleness(7, 6) == 0
    assert lockstep_version(7, origin=0, max_staleness=1) == 5
    assert lockstep_version(2, origin=0, max_staleness=1) == 0  # the start weights until origin + k + 1
    # A run resumed after step 12 samples its first k + 1 batches with the checkpoint's weights.
    assert [lockstep_version(s, origin=12, max_staleness=1) for s in (13, 14, 15)] == [12, 12, 13]
    assert [lockstep_version(s, origin=0, max_staleness=0) for s in (1, 2, 3)] == [0, 1, 2]  # k = 0: sync


def waiting_source(
    *, alive: bool, failed: str | None = None, timeout_s: float = 60.0, exitcode: int = 1
) -> AsyncRollouts:
    """An AsyncRollouts as far as its waits read it: an empty batch queue, a worker alive or dead, and
    the error it said (if any)."""
    src = AsyncRollouts.__new__(AsyncRollouts)
    src.cfg = SimpleNamespace(rollout=SimpleNamespace(timeout_s=timeout_s, lockstep=True, max_staleness=1))
    src.process = SimpleNamespace(
        is_alive=lambda: alive, pid=123, exitcode=exitcode, join=lambda timeout: None
    )
    src.queue, src.failures = queue.Queue(), queue.Queue()
    if failed is not None:
        src.failures.put(WorkerFailed(failed))
    return src


def test_a_dead_worker_ends_the_wait_for_a_batch_with_its_own_error():
    src = waiting_source(alive=False, failed="ValueError: bad prompt\nTraceback ...")
    with pytest.raises(RolloutWorkerError, match="died while generating with exit code 1: ValueError") as err:
        src.sample(3, stats=None)
    assert "Traceback" in err.value.detail  # printed in full, the message is its first line
    assert isinstance(err.value, RolloutSourceError)  # what the loop catches: it knows no worker


def test_a_silent_worker_ends_the_wait_after_the_timeout():
    src = waiting_source(alive=True, timeout_s=0.0)
    with pytest.raises(RolloutWorkerError, match=r"did not deliver a batch within rollout.timeout_s=0"):
        src.sample(3, stats=None)


class Ends(queue.Queue):
    """A batch queue whose worker ends on the run's stop while the trainer waits in get(): the wait sees an
    empty queue, or, mid-hand-over, a broken pipe."""

    def __init__(self, broken: bool) -> None:
        super().__init__()
        self.broken = broken

    def get(self, timeout: float):
        request_stop()  # SIGTERM arrives after the wait's first look at the flag
        if self.broken:
            raise EOFError
        raise queue.Empty


@pytest.mark.parametrize("broken", [False, True], ids=["waiting", "handing-over"])
def test_a_worker_that_ends_on_the_runs_stop_during_the_wait_is_a_stop_not_a_failure(broken):
    # The stop sets the trainer's flag, then the worker's event; the worker finishes its batch loop and
    # exits 0 while the trainer still waits. Exit 75 (saved, resumable), not exit 1 (a dead worker).
    src = waiting_source(alive=False, exitcode=0)
    worker_stop = threading.Event()
    share(worker_stop)
    src.queue = Ends(broken)
    with pytest.raises(StopRequested):
        src.sample(3, stats=None)
    assert worker_stop.is_set()


def test_a_worker_that_breaks_off_a_hand_over_unasked_ends_the_run():
    src = waiting_source(alive=False, exitcode=0)
    src.queue = SimpleNamespace(get=lambda timeout: (_ for _ in ()).throw(EOFError))
    with pytest.raises(RolloutWorkerError, match="died while handing over a batch with exit code 0"):
        src.sample(3, stats=None)
