"""The generation worker's order of work (grpo_run/asynchronous/worker.py), in-process with its channel
and queue replaced by recorders: which weights sample each batch, and which batches are on-policy."""

from types import SimpleNamespace

import pytest

from grpo_run.asynchronous.worker import Worker


class Channel:
    """The versions the trainer sends, in order (lockstep sends none past max_steps - k)."""

    def __init__(self, versions: list[int], idle_polls: int = 0) -> None:
        self.versions = list(versions)
        self.idle_polls = idle_polls  # polls that find nothing sent yet (the trainer evaluating)
        self.polls = 0

    def sent_after(self, version: int) -> bool:
        self.polls += 1
        if self.idle_polls:
            self.idle_polls -= 1
            return False
        return bool(self.versions) and self.versions[0] > version

    def receive(self, flats) -> int:
        return self.versions.pop(0)


class NeverStopped:
    def is_set(self) -> bool:
        return False

    def wait(self) -> None:
        pass


class StoppedAfter:
    """The trainer stops the run after `n` looks at the event."""

    def __init__(self, n: int) -> None:
        self.n = n

    def is_set(self) -> bool:
        self.n -= 1
        return self.n < 0

    def wait(self) -> None:
        pass


def worker(*, max_steps: int, k: int, sent: list[int], on_policy_engine: bool = True) -> tuple[Worker, list]:
    """A Worker whose batches are recorded as (step, version, on-policy) in `events`."""
    events: list[tuple] = []
    w = Worker.__new__(Worker)
    w.cfg = SimpleNamespace(
        rollout=SimpleNamespace(lockstep=True, max_staleness=k), trainer=SimpleNamespace(max_steps=max_steps)
    )
    w.spec = SimpleNamespace(start_step=0)
    w.stop, w.flats, w.version = NeverStopped(), [], -1
    w.channel = Channel(sent)
    w.on_policy_engine = on_policy_engine
    w.side = SimpleNamespace(
        generation=SimpleNamespace(policy_updated=lambda: None, close=lambda: None),
        rewards=SimpleNamespace(close=lambda: None),
    )
    w.produce = lambda step, wait: events.append((step, w.version, w.on_policy(step)))
    w.put = lambda item: None
    return w, events


@pytest.mark.parametrize(
    "k, sent, expected",
    [
        # k = 0: batch s from the weights after s - 1, every one on-policy (the synchronous loop's).
        (0, [0, 1, 2, 3], [(1, 0, True), (2, 1, True), (3, 2, True), (4, 3, True)]),
        # k = 1: batches 1 and 2 from the start weights (batch 1 on-policy), then s from s - 2; the
        # trainer sends no version past max_steps - k = 3.
        (1, [0, 1, 2], [(1, 0, True), (2, 0, False), (3, 1, False), (4, 2, False)]),
    ],
)
def test_lockstep_samples_each_batch_with_the_weights_k_steps_back(k, sent, expected):
    w, events = worker(max_steps=4, k=k, sent=sent)
    w.run()
    assert events == expected


def test_an_engine_with_its_own_kernels_never_hands_over_an_on_policy_batch():
    """vLLM (EngineCapabilities.on_policy false): even at k = 0 its log-probs stay, for the correction."""
    w, events = worker(max_steps=2, k=0, sent=[0, 1], on_policy_engine=False)
    w.run()
    assert events == [(1, 0, False), (2, 1, False)]


def test_a_worker_waits_for_weights_as_long_as_the_trainer_is_busy_without_a_timed_out_receive():
    """The trainer evaluates before it sends the next weights, perhaps for longer than the channel's
    timeout: the worker polls whether they are on their way instead of blocking in a receive, then takes
    them; a stop while it waits ends it quietly."""
    w, events = worker(max_steps=3, k=0, sent=[0, 1, 2])
    w.channel = Channel([0, 1, 2], idle_polls=40)
    w.run()
    assert events == [(1, 0, True), (2, 1, True), (3, 2, True)] and w.channel.polls > 40
    w, events = worker(max_steps=3, k=0, sent=[0])
    w.stop = StoppedAfter(5)
    w.run()  # batch 1, then it waits for version 1, which never comes: stopped, no error
    assert events == [(1, 0, True)]
