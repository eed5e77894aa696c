"""While the run loads there is nothing to save: the signal catcher ends the load at once by raising
`LoadingStopped` from the handler (a BaseException: a loader's `except Exception` cannot swallow it);
once the run is built (`loaded`), a stop is only recorded, for the loop's stop points."""

import os
import signal
import threading
import time

import pytest

from grpo_run.safety import stop
from grpo_run.safety.signals import LoadingStopped, SignalCatcher


@pytest.fixture(autouse=True)
def _handlers_back():
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)}
    yield
    for signum, handler in previous.items():
        signal.signal(signum, handler)


def a_loader_that_swallows_errors() -> None:
    try:
        time.sleep(30)  # a slow user hook
    except Exception:
        pass


def test_a_stop_while_loading_leaves_the_load_at_once_and_a_second_is_ignored():
    with SignalCatcher(loading=True) as catcher:
        t0 = time.monotonic()
        with pytest.raises(LoadingStopped):
            threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGUSR1)).start()
            a_loader_that_swallows_errors()
        assert time.monotonic() - t0 < 5
        assert catcher.signum == signal.SIGUSR1 and stop.stop_requested()
        os.kill(os.getpid(), signal.SIGTERM)  # already stopping: recorded as ignored, nothing raised
        assert catcher.signum == signal.SIGUSR1


def test_once_loaded_a_stop_is_only_recorded():
    with SignalCatcher(loading=True) as catcher:
        catcher.loaded()
        os.kill(os.getpid(), signal.SIGTERM)
        assert catcher.received and stop.stop_requested()
