"""A verifier that hangs, for tests/integration/test_reliability.py. A module of its own, with no heavy
imports, so the reward pool's worker process imports it in no time."""

import os
import time
from pathlib import Path

HANG_S = 30.0


def hangs_on_last_call(prompts, completions, answers, **kwargs):
    """Scores 0, except that call number GRPO_RUN_TEST_HANG_AT (counted in a file) sleeps for 30 s."""
    counter = Path(os.environ["GRPO_RUN_TEST_HANG_COUNTER"])
    calls = int(counter.read_text()) + 1 if counter.exists() else 1
    counter.write_text(str(calls))  # the pool runs one call at a time, so this count is exact
    if calls == int(os.environ["GRPO_RUN_TEST_HANG_AT"]):
        time.sleep(HANG_S)
    return [0.0] * len(completions)


def slow_from_marked_call(prompts, completions, **kwargs):
    """A user's reward (TRL's form) that scores 0, except that call number GRPO_RUN_TEST_SLOW_AT (counted
    in the file GRPO_RUN_TEST_SLOW_COUNTER) touches the file GRPO_RUN_TEST_SLOW_MARKER and then takes
    SLOW_S: a reward that is slow on one completion. Without the variables it is fast."""
    at = os.environ.get("GRPO_RUN_TEST_SLOW_AT")
    if at is not None:
        counter = Path(os.environ["GRPO_RUN_TEST_SLOW_COUNTER"])
        calls = int(counter.read_text()) + 1 if counter.exists() else 1
        counter.write_text(str(calls))  # one worker, one call at a time: the count is exact
        if calls == int(at):
            Path(os.environ["GRPO_RUN_TEST_SLOW_MARKER"]).touch()
            time.sleep(SLOW_S)
    return [float("a" in c) for c in completions]


SLOW_S = 60.0
