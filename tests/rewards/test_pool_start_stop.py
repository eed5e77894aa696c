"""A reward worker's start (or restart) waits in slices and gives way to a stop: a reward model that
takes minutes to load never holds a stopping run (grpo_run/scoring/pool.py)."""

import threading
import time

import pytest

from grpo_run.safety import stop
from grpo_run.safety.stop import StopRequested
from grpo_run.scoring.pool import RewardPool

LOAD_S = 30.0


def slow_load() -> None:
    """A worker's preparation that takes LOAD_S (a reward model loading)."""
    time.sleep(LOAD_S)


def scores_one(x):
    return 1.0


def stop_in(seconds: float) -> None:
    threading.Timer(seconds, stop.request_stop).start()


def test_a_stop_during_a_workers_start_raises_at_once_and_kills_the_worker():
    pool = RewardPool(preload=(), start_timeout_s=120)
    stop_in(1.0)
    t0 = time.monotonic()
    with pytest.raises(StopRequested):
        pool.start(scores_one, prepare=slow_load)
    assert time.monotonic() - t0 < LOAD_S / 2
    assert pool._executor is None  # its worker killed, not left loading


def test_a_stop_during_a_workers_restart_abandons_the_wave():
    """`run` starts the worker (as after a death): the stop abandons the calls, nothing is scored as an
    error or counted as a restart."""
    pool = RewardPool(preload=(), start_timeout_s=120)
    stop_in(1.0)
    t0 = time.monotonic()
    outcomes = pool.run(scores_one, [((1,), {}), ((2,), {})], timeout_s=60, prepare=slow_load)
    assert time.monotonic() - t0 < LOAD_S / 2
    assert [o.timed_out for o in outcomes] == [True, True]
    assert all("stopping" in o.error for o in outcomes)
    assert pool.restarts == 0 and pool._executor is None


def test_without_a_stop_the_start_waits_for_the_preparation():
    with RewardPool(preload=(), start_timeout_s=120) as pool:
        outcomes = pool.run(scores_one, [((1,), {})], timeout_s=60, prepare=quick_load)
    assert [o.value for o in outcomes] == [1.0] and not outcomes[0].timed_out


def quick_load() -> None:
    time.sleep(0.5)
