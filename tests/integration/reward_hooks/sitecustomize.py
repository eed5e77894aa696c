"""Test-only hook for tests/integration/test_faults.py: reward workers that die at a chosen step.

The test puts this folder on PYTHONPATH, so every process imports it at start-up; it acts only in a reward
worker (a multiprocessing spawn child) and only when GRPO_TEST_REWARD_CALLS names a counter file:
- each math_verifier call adds one to the count in that file;
- once GRPO_TEST_KILL_AFTER calls have been scored, the worker dies by os._exit at its next call, as an
  OOM kill would, and so does every replacement, so the step's rewards can never be scored;
- or, with GRPO_TEST_SIGKILL_ONCE=1, the worker sends itself SIGKILL (what the OOM killer sends) at that
  call once only: its replacement scores the call and every later one.
"""

import os
import sys

if os.environ.get("GRPO_TEST_REWARD_CALLS") and "spawn_main" in " ".join(getattr(sys, "orig_argv", [])):
    from pathlib import Path

    import grpo_run.rewards.functions as functions

    counter = Path(os.environ["GRPO_TEST_REWARD_CALLS"])
    kill_after = int(os.environ["GRPO_TEST_KILL_AFTER"])
    real_math_verifier = functions.math_verifier

    def math_verifier(*args, **kwargs):
        done = int(counter.read_text()) if counter.exists() else 0
        if done >= kill_after:
            if os.environ.get("GRPO_TEST_SIGKILL_ONCE") != "1":
                os._exit(1)
            killed = counter.with_suffix(".killed")
            if not killed.exists():
                killed.touch()
                import signal

                os.kill(os.getpid(), signal.SIGKILL)
        counter.write_text(str(done + 1))
        return real_math_verifier(*args, **kwargs)

    # The pool pickles the function by name: the worker unpickles this one.
    functions.math_verifier = math_verifier
