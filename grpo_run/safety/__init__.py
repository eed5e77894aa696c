"""Run safety: what keeps a run from losing work.

signals.py        SIGTERM / SIGUSR1 (a scheduler's preemption): finish the step, save, exit 75, requeue
run_lock.py       one run per run dir
writable.py       the run dir can be written, before Hydra logs there
resume_policy.py  which config keys may change on resume (applied) and which may not (refused by name)
secrets.py        key-like values redacted in everything the run writes
"""
