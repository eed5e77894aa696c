"""Run safety: what keeps a run from losing work.

signals.py        SIGTERM / SIGUSR1 (a scheduler's preemption): finish the step, save, exit 75, requeue
run_lock.py       one run per run dir
writable.py       the run dir can be written, before Hydra logs there
resume_policy.py  which config keys may change on resume (applied) and which may not (refused by name), and
                  whether a resume leaves steps to train
update_norm.py    how far an optimizer step moved the trainable parameters (train/update_norm), exactly
accounting.py     every scored completion trained or counted as dropped, or the run stops
secrets.py        key-like values redacted in everything the run writes
"""
