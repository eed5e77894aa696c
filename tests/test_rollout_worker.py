"""The generation worker's order of work (grpo_run/rollout_worker.py), in-process with its engine, channel and
queues replaced by recorders: which weights sample each batch, and when a due version is evaluated."""

from types import SimpleNamespace

import pytest

from grpo_run.rollout_worker import BUSY, DONE, Worker


class Channel:
    """The versions the trainer sends, in order (lockstep sends no version past max_steps - k that is not
    due for an evaluation); `on_receive` sees each receive before it returns."""

    def __init__(self, versions: list[int], on_receive=lambda: None) -> None:
        self.versions = list(versions)
        self.on_receive = on_receive

    def receive(self, flats) -> int:
        self.on_receive()
        return self.versions.pop(0)


class NeverStopped:
    def is_set(self) -> bool:
        return False

    def wait(self) -> None:
        self.waited_as = self.waiting.value  # what the trainer reads while the worker waits to be stopped


def worker(*, max_steps: int, k: int, eval_steps: set[int], sent: list[int]) -> tuple[Worker, list]:
    """A Worker whose batches, evaluations and weights are recorded in `events`."""
    events: list[tuple] = []
    w = Worker.__new__(Worker)
    w.cfg = SimpleNamespace(
        rollout=SimpleNamespace(lockstep=True, max_staleness=k), trainer=SimpleNamespace(max_steps=max_steps)
    )
    w.spec = SimpleNamespace(start_step=0, origin=0)
    w.waiting = SimpleNamespace(value=BUSY)
    w.stop, w.flats, w.version = NeverStopped(), [], -1
    w.stop.waiting = w.waiting
    w.channel = Channel(sent, on_receive=lambda: events.append(("waits for", w.waiting.value)))
    w.eval_steps = set(eval_steps)
    w.engine = SimpleNamespace(policy_updated=lambda: None, close=lambda: None)
    w.rewards = SimpleNamespace(close=lambda: None)

    def produce(step: int, wait: float) -> None:
        assert w.waiting.value == BUSY  # never lends its threads while it samples
        events.append(("batch", step, w.version))

    w.produce = produce
    w.put = lambda item: None

    def evaluate(step: int) -> None:
        assert step == w.version  # the weights of the evaluated step, not later ones
        assert w.waiting.value == BUSY
        events.append(("eval", step))
        w.eval_steps.discard(step)

    w.evaluate = evaluate
    return w, events


@pytest.mark.parametrize("k", [0, 1])
def test_a_due_version_is_evaluated_after_the_batches_it_samples(k):
    """max_steps 4, evaluations at 0, 2, 4. k = 1: batches 1 and 2 are the start weights' (version 0), 3
    version 1's, 4 version 2's; the trainer sends 0, 1, 2 and then only 4 (3 samples nothing and is not due).
    Step 0's evaluation comes after batches 1 and 2, which the trainer waits for first, and before version
    1 replaces version 0; step 2's after batch 4; step 4's once its weights came. k = 0: batch s is
    version s - 1's, so each evaluation follows the one batch its version samples."""
    sent = [0, 1, 2, 4] if k == 1 else [0, 1, 2, 3, 4]
    w, events = worker(max_steps=4, k=k, eval_steps={0, 2, 4}, sent=sent)
    w.run()
    events = [e for e in events if e[0] != "waits for"]
    if k == 1:
        assert events == [
            ("batch", 1, 0),
            ("batch", 2, 0),
            ("eval", 0),
            ("batch", 3, 1),
            ("batch", 4, 2),
            ("eval", 2),
            ("eval", 4),
        ]
    else:
        assert events == [
            ("batch", 1, 0),
            ("eval", 0),
            ("batch", 2, 1),
            ("batch", 3, 2),
            ("eval", 2),
            ("batch", 4, 3),
            ("eval", 4),
        ]


@pytest.mark.parametrize("final_eval", [False, True])
@pytest.mark.parametrize("k", [1, 2])
def test_the_worker_says_it_is_blocked_only_once_it_has_made_what_its_weights_sample(k, final_eval):
    """rollout.lend_threads: while the worker blocks for newer weights it says which version it holds,
    BUSY while it samples or evaluates, DONE once it only waits to be stopped. The trainer lends its
    threads to an update once it holds the newest version sent (rollout_source.worker_blocked); by then
    the worker has made every batch those weights sample (holding v: batches up to v + 1 + k). Lockstep
    sends nothing past max_steps - k - 1 but the final weights when they are due for an evaluation,
    which the worker then waits for holding version max_steps - k - 1 through the last k steps."""
    max_steps = 6
    sent = list(range(max_steps - k)) + ([max_steps] if final_eval else [])
    w, events = worker(max_steps=max_steps, k=k, eval_steps={max_steps} if final_eval else set(), sent=sent)
    w.run()
    assert w.stop.waited_as == DONE and w.waiting.value == DONE
    waits = [e[1] for e in events if e[0] == "waits for"]
    held = list(range(-1, max_steps - k - 1))  # -1: before the start weights came
    assert waits == held + ([max_steps - k - 1] if final_eval else [])
    for i, event in enumerate(events):
        if event[0] == "waits for" and event[1] >= 0:
            made = {e[1] for e in events[:i] if e[0] == "batch"}
            assert set(range(1, min(event[1] + 1 + k, max_steps) + 1)) <= made, (event, made)
