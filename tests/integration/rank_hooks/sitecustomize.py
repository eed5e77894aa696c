"""Test-only hooks for the ranks of a distributed `grpo-run` (test_distributed.py, test_rank_faults.py).

The tests put this folder on PYTHONPATH, so Python imports it at start-up in every process; it acts only
in a rank (started by `grpo-run` or torchrun) running `grpo_run.cli`, or in a spawned process when one of
the worker's variables is set, and leaves production code untouched:
- GRPO_TEST_DIGEST_DIR: after training, each rank writes `rank<R>.sha256`, a digest of its own
  parameters as they are in memory (so the test can see that every rank ends identical).
- GRPO_TEST_FAIL_RANK / GRPO_TEST_FAIL_STEP: that rank raises at the start of that step, after writing
  the time to GRPO_TEST_FAIL_STAMP.
- GRPO_TEST_HOLD_RANKS (e.g. "0,1") / GRPO_TEST_HOLD_STEP / GRPO_TEST_HOLD_DIR: at the start of that
  step each of those ranks writes its pid to `<dir>/rank<R>.held` and waits (up to 120 s) until it has
  caught a stop signal, so a test signals every rank inside one known step.
- GRPO_TEST_STALL_RANK / GRPO_TEST_STALL_STEP / GRPO_TEST_HOLD_DIR: that rank writes its pid and the time
  to `<dir>/rank<R>.stalled` at the start of that step, then stops itself (SIGSTOP): a stalled rank.
  With GRPO_TEST_STALL_IN=reduce it does so inside that step's first ZeRO gradient reduction instead
  (`DeepSpeedZeroOptimizer.allreduce_bucket`, on DeepSpeed's own clone of the world group), while the
  other rank waits in it.
- GRPO_TEST_WORKER_DIE_AT_EVAL: in the generation worker of rollout=async, see the end of this file.
"""

import os
import sys

if "grpo_run.cli" in getattr(sys, "orig_argv", []) and "LOCAL_RANK" in os.environ:
    import hashlib
    import signal
    import time
    from pathlib import Path

    import grpo_run.trainer as trainer

    rank = int(os.environ["RANK"])
    digest_dir = os.environ.get("GRPO_TEST_DIGEST_DIR")
    fail_rank = os.environ.get("GRPO_TEST_FAIL_RANK")
    fail_step = int(os.environ.get("GRPO_TEST_FAIL_STEP", "0"))
    hold_ranks = {int(r) for r in os.environ.get("GRPO_TEST_HOLD_RANKS", "").split(",") if r}
    hold_step = int(os.environ.get("GRPO_TEST_HOLD_STEP", "0"))
    stall_rank = os.environ.get("GRPO_TEST_STALL_RANK")
    stall_step = int(os.environ.get("GRPO_TEST_STALL_STEP", "0"))
    hold_dir = os.environ.get("GRPO_TEST_HOLD_DIR", "")
    real_train_step, real_save_final = trainer.train_step, trainer.save_final
    real_catcher = trainer.SignalCatcher
    catchers = []

    class RecordedCatcher(real_catcher):
        def install(self):
            catchers.append(self)
            return super().install()

    def stamp(kind, text):
        tmp = Path(hold_dir, f".rank{rank}.{kind}")
        tmp.write_text(text)
        tmp.rename(Path(hold_dir, f"rank{rank}.{kind}"))  # whole, never half-written

    def train_step(ctx, state, step):
        if fail_rank is not None and rank == int(fail_rank) and step == fail_step:
            # When it failed, so the test can time the shutdown apart from the start-up.
            Path(os.environ["GRPO_TEST_FAIL_STAMP"]).write_text(repr(time.time()))
            raise RuntimeError(f"injected failure on rank {rank} at step {step}")
        if rank in hold_ranks and step == hold_step:
            stamp("held", str(os.getpid()))
            deadline = time.time() + 120
            while not catchers[-1].received and time.time() < deadline:
                time.sleep(0.05)
        if stall_rank is not None and rank == int(stall_rank) and step == stall_step:
            if stall_in != "reduce":
                stall()
            stalling.append(step)  # the reduction's hook stops this rank
        return real_train_step(ctx, state, step)

    def stall():
        stamp("stalled", f"{os.getpid()} {time.time()!r}")
        os.kill(os.getpid(), signal.SIGSTOP)

    stall_in = os.environ.get("GRPO_TEST_STALL_IN")
    stalling = []
    if stall_in == "reduce":
        from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

        real_allreduce_bucket = DeepSpeedZeroOptimizer.allreduce_bucket

        def allreduce_bucket(self, *args, **kwargs):
            if stalling:
                stalling.clear()
                stall()
            return real_allreduce_bucket(self, *args, **kwargs)

        DeepSpeedZeroOptimizer.allreduce_bucket = allreduce_bucket

    def save_final(ctx):
        if digest_dir:
            h = hashlib.sha256()
            for name, p in sorted(ctx.engine.module.named_parameters()):
                h.update(name.encode())
                h.update(p.detach().float().cpu().numpy().tobytes())
            Path(digest_dir, f"rank{rank}.sha256").write_text(h.hexdigest())
        real_save_final(ctx)

    trainer.train_step, trainer.save_final = train_step, save_final
    trainer.SignalCatcher = RecordedCatcher

# GRPO_TEST_WORKER_DIE_AT_BATCH=N: the generation worker of rollout=async (a spawned process, not a rank)
# kills itself with SIGKILL, as the OOM killer would, when it starts sampling batch N, once the trainer
# has taken and rebuilt every batch it made before (a kill during a hand-over would lose that batch).
if (
    "--multiprocessing-fork" in getattr(sys, "orig_argv", [])
    and "GRPO_TEST_WORKER_DIE_AT_BATCH" in os.environ
):
    import signal
    import time

    import grpo_run.asynchronous.worker as async_worker

    die_at = int(os.environ["GRPO_TEST_WORKER_DIE_AT_BATCH"])
    real_produce = async_worker.Worker.produce

    def produce(self, step, wait_s):
        if step == die_at:
            # qsize: batches put and not yet taken (the bounded queue's semaphore), those its feeder
            # thread has still to write included; empty() looks at the pipe only, before that write.
            while self.queue.qsize() > 0:
                time.sleep(0.05)
            # Taken is not yet rebuilt: the trainer fetches the batch's shared-memory tensors from this
            # process after reading its bytes (a kill then is "died while handing over a batch", which the
            # product reports as such). A moment more, and the trainer waits for the next batch instead.
            time.sleep(2.0)
            os.kill(os.getpid(), signal.SIGKILL)
        return real_produce(self, step, wait_s)

    async_worker.Worker.produce = produce
