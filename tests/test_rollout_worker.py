"""The generation worker's order of work (grpo_run/rollout_worker.py), in-process with its engine, channel and
queues replaced by recorders: which weights sample each batch, and when a due version is evaluated."""

from types import SimpleNamespace

import pytest

from grpo_run.rollout_worker import Worker


class Channel:
    """The versions the trainer sends, in order (lockstep sends no version past max_steps - k that is not
    due for an evaluation)."""

    def __init__(self, versions: list[int]) -> None:
        self.versions = list(versions)

    def receive(self, flats) -> int:
        return self.versions.pop(0)


class NeverStopped:
    def is_set(self) -> bool:
        return False

    def wait(self) -> None:
        pass


def worker(*, max_steps: int, k: int, eval_steps: set[int], sent: list[int]) -> tuple[Worker, list]:
    """A Worker whose batches, evaluations and weights are recorded in `events`."""
    events: list[tuple] = []
    w = Worker.__new__(Worker)
    w.cfg = SimpleNamespace(
        rollout=SimpleNamespace(lockstep=True, max_staleness=k), trainer=SimpleNamespace(max_steps=max_steps)
    )
    w.spec = SimpleNamespace(start_step=0, origin=0)
    w.stop, w.channel, w.flats, w.version = NeverStopped(), Channel(sent), [], -1
    w.eval_steps = set(eval_steps)
    w.engine = SimpleNamespace(policy_updated=lambda: None, close=lambda: None)
    w.rewards = SimpleNamespace(close=lambda: None)
    w.produce = lambda step, wait: events.append(("batch", step, w.version))
    w.put = lambda item: None

    def evaluate(step: int) -> None:
        assert step == w.version  # the weights of the evaluated step, not later ones
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
