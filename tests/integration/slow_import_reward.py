"""A user's reward module that is slow to import, for tests/integration/test_stop_anytime.py: a real
user hook, imported the way grpo-run imports any `reward.functions[i]._target_`.

- GRPO_RUN_TEST_SLOW_IMPORT=trainer: importing it in the trainer's process (the reward check imports
  every target before any model loads) touches GRPO_RUN_TEST_SLOW_MARKER, then takes SLOW_S.
- GRPO_RUN_TEST_SLOW_IMPORT=worker: each import in a reward worker process (its start, and each restart
  after a worker died) is counted in GRPO_RUN_TEST_SLOW_DIR; from the second one on it touches the
  marker, then takes SLOW_S: a worker whose restart loads something slow (a reward model reloading).
- GRPO_RUN_TEST_DIE_AT=N: call number N of the reward (counted in that folder) ends its worker process
  (os._exit), once: a worker that crashed, so the pool restarts it.
Without the variables it is an ordinary fast reward.
"""

import multiprocessing
import os
import time
from pathlib import Path

SLOW_S = 60.0


def _count(name: str) -> int:
    """Add one to the counter file `name` in GRPO_RUN_TEST_SLOW_DIR; the new count."""
    path = Path(os.environ["GRPO_RUN_TEST_SLOW_DIR"], name)
    count = int(path.read_text()) + 1 if path.exists() else 1
    path.write_text(str(count))  # one worker, one call at a time: the count is exact
    return count


def _slow() -> None:
    Path(os.environ["GRPO_RUN_TEST_SLOW_MARKER"]).touch()
    time.sleep(SLOW_S)


_where = os.environ.get("GRPO_RUN_TEST_SLOW_IMPORT")
_in_worker = multiprocessing.parent_process() is not None
if _where == "trainer" and not _in_worker:
    _slow()
elif _where == "worker" and _in_worker and _count("imports") >= 2:
    _slow()


def a_fraction(prompts, completions, **kwargs):
    """TRL's form: the share of 'a' in each completion."""
    die_at = os.environ.get("GRPO_RUN_TEST_DIE_AT")
    if die_at is not None and _count("calls") == int(die_at):
        os._exit(3)
    return [c.count("a") / max(len(c), 1) for c in completions]
