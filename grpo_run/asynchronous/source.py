"""The trainer's side of rollout=async: batches from the generation worker (worker.py), each one's
staleness checked and logged, and the weights sent to it after every step (weight_channel.py).

AsyncRollouts  one training process: the worker beside it, on the device `rollout.device` names
RankShares     several training ranks (distributed=zero2): one worker beside rank 0, each rank's share
               scattered over torch.distributed
"""

import os
import queue as queue_errors
import time
from collections.abc import Callable, Sequence

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from grpo_run import metrics as M
from grpo_run.asynchronous.placement import (
    CPU,
    VISIBLE,
    own_device,
    spawn_environment,
    tensors_to,
    training_gpus,
    worker_device,
    worker_environment,
)
from grpo_run.asynchronous.weight_channel import (
    TRAINER,
    WeightChannel,
    channel_backend,
    flatten,
    joined,
    open_store,
    sync_tensors,
)
from grpo_run.asynchronous.worker import READY_KEY, Produced, WorkerFailed, WorkerSpec, run_worker
from grpo_run.config.schema import Config
from grpo_run.data import Example, PromptSampler
from grpo_run.rollout.groups import Sampled, ScoredGroups, select_groups
from grpo_run.rollout.source import RolloutSourceError
from grpo_run.safety.stop import StopRequested, share, stop_requested, unshare
from grpo_run.tracking import console

# How often a trainer waiting for groups looks whether the worker is still alive.
POLL_S = 0.5
# How long a stopped worker gets to exit before it is killed.
STOP_GRACE_S = 5.0
# How often the trainer looks whether the previous weight sync is done (short: it is on the step's path).
SYNC_POLL_S = 0.002


class RolloutWorkerError(RolloutSourceError):
    """The generation worker died, failed or went silent; the run ends (exit 1) after saving what it trained."""


def staleness(step: int, version: int) -> int:
    """Steps between the weights that sampled a batch and those step `step` trains (version step - 1)."""
    return step - 1 - version


class AsyncRollouts:
    """rollout=async on one training process: batches from the generation worker, each one's staleness
    checked and logged; the weights go to the worker after every step that a batch still needs."""

    def __init__(
        self,
        cfg: Config,
        *,
        policy: PreTrainedModel,
        lora: bool,
        tokenizer: PreTrainedTokenizerBase,
        examples: Sequence[Example],
        sampler: PromptSampler,
        start_step: int,
        device: torch.device,
    ) -> None:
        """`device`: where `sample` hands the batches over; `lora`: the policy holds LoRA modules (the
        worker's plain copy receives the merged weights)."""
        self.cfg, self.policy, self.lora, self.sampler, self.device = cfg, policy, lora, sampler, device
        r = cfg.rollout
        trainer = next(policy.parameters()).device
        # A ConfigError for a rollout.device this node cannot serve, before anything starts.
        worker = worker_device(r.device, trainer, training_gpus(cfg), torch.cuda.device_count())
        backend = channel_backend(trainer, worker)
        mp = torch.multiprocessing.get_context("spawn")
        store, port = open_store(r.timeout_s)
        # lockstep: the worker is at most max_staleness batches ahead of the one the trainer waits for.
        self.queue = mp.Queue(maxsize=r.max_staleness + 1)
        self.failures = mp.Queue()  # unbounded: a full batch queue never holds the worker's error back
        self.stop = mp.Event()
        share(self.stop)  # a stop signal to the trainer stops the worker's sampling at once
        spec = WorkerSpec(
            cfg,
            tokenizer,
            list(examples),
            sampler.state_dict(),
            start_step,
            port,
            device=str(own_device(worker)),
            channel_backend=backend,
            dtypes=tuple(t.dtype for t in sync_tensors(policy, lora)),
        )
        self.process = mp.Process(
            target=run_worker, args=(spec, self.queue, self.stop, self.failures), name="grpo-run-generation"
        )
        # The worker sees its GPU alone (as cuda:0), from before its first import to vLLM's engine.
        with spawn_environment(worker_environment(worker, os.environ.get(VISIBLE))):
            self.process.start()
        console.print(
            f"rollout=async: generation worker pid {self.process.pid} on {worker} (weights over {backend}), "
            f"{r.threads} thread(s), max_staleness={r.max_staleness}, lockstep={r.lockstep}",
            soft_wrap=True,
            markup=False,
            highlight=False,
        )
        self.channel = None
        self._until(lambda: joined(store, READY_KEY), "starting", "start")  # it loads its model first
        self.channel = WeightChannel(
            TRAINER, port=port, timeout_s=r.timeout_s, store=store, backend=backend, device=trainer
        )
        self._send(start_step)

    def _until(self, done: Callable[[], bool], doing: str, silent: str, poll_s: float = 0.05) -> bool:
        """Wait until `done()`, watching the worker: a dead one, or one silent for rollout.timeout_s, ends
        the run with a RolloutWorkerError. False: the run is stopping (the worker stops too)."""
        deadline = time.monotonic() + self.cfg.rollout.timeout_s
        while not done():
            if self._stopping(doing):
                return False
            if time.monotonic() > deadline:
                raise RolloutWorkerError(self._silent(silent))
            time.sleep(poll_s)
        return True

    def _send(self, version: int) -> None:
        """The policy's weights to the worker as `version`, once the previous sync has reached it. Under
        NCCL a sync the worker never takes would otherwise hold the trainer's GPU stream until NCCL's
        watchdog ends the whole process, with nothing saved."""
        buffers = flatten(sync_tensors(self.policy, self.lora))
        if self._until(self.channel.done, "receiving weights", "receive the weights", SYNC_POLL_S):
            self.channel.send(version, buffers)  # not when stopping: the worker takes no more weights

    def _stopping(self, doing: str) -> bool:
        """Whether the run is stopping. A worker that ended raises a RolloutWorkerError, unless the run is
        stopping: a stop ends the worker too, and may do so while this process waits on it."""
        # Stopping sets this process's flag before the worker's event, so a worker that ended on a stop
        # always finds the flag set here.
        if not self.process.is_alive() and not stop_requested():
            self._raise_dead(doing)
        return stop_requested()

    def _raise_dead(self, doing: str) -> None:
        message = f"the generation worker (pid {self.process.pid}) died while {doing}"
        message += f" with exit code {self.process.exitcode}"
        for source in (self.failures, self.queue):
            try:
                while True:
                    item = source.get(timeout=1.0)
                    if isinstance(item, WorkerFailed):  # its error and traceback
                        raise RolloutWorkerError(f"{message}: {item.message.splitlines()[0]}", item.message)
            except (queue_errors.Empty, EOFError, OSError):
                pass
        raise RolloutWorkerError(message)

    def _silent(self, doing: str) -> str:
        return (
            f"the generation worker (pid {self.process.pid}) did not {doing} within "
            f"rollout.timeout_s={self.cfg.rollout.timeout_s:g} seconds"
        )

    def _next(self) -> Produced:
        deadline = time.monotonic() + self.cfg.rollout.timeout_s
        while True:
            if stop_requested():  # the worker stops too: whatever it was making is not trained
                raise StopRequested
            try:
                return self.queue.get(timeout=POLL_S)
            except queue_errors.Empty:
                if self._stopping("generating"):  # a failed worker says why, then exits
                    raise StopRequested from None
                if time.monotonic() > deadline:
                    raise RolloutWorkerError(self._silent("deliver a batch")) from None
            except (EOFError, OSError):  # it ended while handing a batch's tensors over
                self.process.join(timeout=STOP_GRACE_S)
                if self._stopping("handing over a batch"):
                    raise StopRequested from None
                raise RolloutWorkerError(
                    f"the generation worker (pid {self.process.pid}) broke off handing over a batch"
                ) from None

    def sample(self, step: int, stats: M.StepMetrics) -> Sampled:
        k = self.cfg.rollout.max_staleness
        t0 = time.perf_counter()
        dropped, stale_completions = 0, 0.0
        while True:
            item = self._next()
            if self.cfg.rollout.lockstep and item.step != step:  # lockstep hands over batches in step order
                raise RolloutWorkerError(f"step {step} got the generation worker's batch {item.step}")
            lag = staleness(step, item.version)
            # The checkpoint after this step continues after this batch, dropped ones included.
            self.sampler.load_state_dict(item.sampler_state)
            if lag <= k:
                break
            dropped += 1  # too old to train on: counted, never used
            stale_completions += scored_completions(item)
        wait = time.perf_counter() - t0
        sampled = tensors_to(item.sampled, self.device)  # the worker hands its batches over on the CPU
        stats.merge(item.stats)  # moved to the stats' device there
        stats.add_mean(M.ASYNC_STALENESS_MEAN, float(lag), 1.0)
        stats.add_max(M.ASYNC_STALENESS_MAX, float(lag))
        stats.add_sum(M.ASYNC_DROPPED_STALE, float(dropped))
        # The dropped batches' completions were scored too: counted as scored and dropped as stale.
        stats.add_sum(M.SCORED_COMPLETIONS, stale_completions)
        stats.add_sum(M.DROPPED_STALE, stale_completions)
        stats.set_host(M.ASYNC_TRAINER_WAIT_S, wait)
        stats.set_host(M.ASYNC_GENERATOR_WAIT_S, item.wait_s)
        stats.set_host(M.ASYNC_GENERATE_S, item.generate_s)
        # perf/generate_s: the time this step spent getting its groups (here the wait), so that the
        # step's time still splits into generation, reference and training.
        return Sampled(sampled.groups, sampled.described, wait, sampled.tokens)

    def trained(self, step: int, stats: M.StepMetrics) -> None:
        r, last = self.cfg.rollout, self.cfg.trainer.max_steps
        t = time.perf_counter()
        # Lockstep samples no batch with the weights after step max_steps - max_staleness or later.
        if step < (last - r.max_staleness if r.lockstep else last):
            self._send(step)
        stats.set_host(M.WEIGHT_SYNC_S, time.perf_counter() - t)

    def close(self) -> None:
        unshare(self.stop)
        self.stop.set()
        self.process.join(STOP_GRACE_S)
        if self.process.is_alive():  # blocked in a weight sync the trainer will not send
            self.process.kill()
            self.process.join(STOP_GRACE_S)
        if self.channel is not None:
            self.channel.close()
        for q in (self.queue, self.failures):
            q.cancel_join_thread()
            q.close()


def scored_completions(item: Produced) -> float:
    """The completions the worker scored for `item` (its train/scored_completions)."""
    sums = item.stats[0]
    return float(sums[M.SCORED_COMPLETIONS]) if M.SCORED_COMPLETIONS in sums else 0.0


class RankShares:
    """rollout=async on several training ranks (distributed=zero2): one generation worker, beside rank 0,
    samples each step's B prompts as one process would (the seeds are the global prompt indices, so the
    groups are those the synchronous ranks sample), and rank 0 hands each rank its contiguous B/world
    share over torch.distributed (`Engine.scatter_objects`), with the sampler's position. Under ZeRO-2
    every rank holds the full weights, so rank 0 alone sends them to the worker after each step. A dead
    worker reaches every rank as the same error, so all save and stop together. The shares travel on the
    CPU (a pickled GPU tensor would be opened on the sender's device index); each rank moves its own to
    `device`."""

    def __init__(
        self,
        worker: AsyncRollouts | None,
        *,
        sampler: PromptSampler,
        world_size: int,
        scatter: Callable[[list | None], object],
        device: torch.device,
    ) -> None:
        self.worker, self.sampler, self.world_size, self.scatter = worker, sampler, world_size, scatter
        self.device = device

    def sample(self, step: int, stats: M.StepMetrics) -> Sampled:
        shares = None
        if self.worker is not None:
            try:
                own = M.StepMetrics(CPU)  # the worker's counts and the async/* metrics
                whole = self.worker.sample(step, own)
                # Kept groups that do not divide over the ranks are cut (split_sampled): counted.
                own.add_sum(M.DROPPED_RANK_BALANCE, float(uneven_completions(whole, self.world_size)))
                state = self.sampler.state_dict()
                counted = [own.parts()] + [uncounted(own.parts())] * (self.world_size - 1)
                parts = split_sampled(whole, self.world_size)
                shares = [("ok", p, state, c) for p, c in zip(parts, counted, strict=True)]
            except RolloutWorkerError as err:
                shares = [("failed", str(err), err.detail)] * self.world_size
            except StopRequested:  # said to every rank in the scatter they all wait in
                shares = [("stopped",)] * self.world_size
        kind, *rest = self.scatter(shares)
        if kind == "failed":
            raise RolloutWorkerError(rest[0], rest[1])
        if kind == "stopped":
            raise StopRequested
        part, state, counts = rest
        # Every rank logs the same keys in the same order (the step's metrics are one all-reduce of
        # them); only rank 0's values count.
        stats.merge(counts)
        self.sampler.load_state_dict(state)
        return tensors_to(part, self.device)

    def trained(self, step: int, stats: M.StepMetrics) -> None:
        if self.worker is not None:
            self.worker.trained(step, stats)

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()


def uncounted(parts: tuple[dict, dict, dict, dict]) -> tuple[dict, dict, dict, dict]:
    """`StepMetrics.parts` with the same keys adding nothing: sums and counts 0, the same maxima."""
    sums, counts, maxes, host = parts
    zeros = {k: torch.zeros_like(v) for k, v in sums.items()}
    return zeros, {k: torch.zeros_like(v) for k, v in counts.items()}, dict(maxes), dict(host)


def uneven_completions(sampled: Sampled, world_size: int) -> int:
    """Completions of the kept groups that `split_sampled` leaves out: those past a multiple of
    world_size, or all of them when there are fewer groups than ranks."""
    if sampled.groups is None:
        return 0
    groups, size = len(sampled.groups.examples), sampled.groups.rewards.size(1)
    trained = groups // world_size * world_size
    return (groups - trained) * size


def split_sampled(sampled: Sampled, world_size: int) -> list[Sampled]:
    """A step's groups as world_size contiguous, equal shares (rank r: groups r·n .. (r+1)·n − 1). Kept
    groups that do not divide evenly (dynamic sampling that hit its round bound) are cut to a multiple
    of world_size; none left: no rank trains. The step's token count stays with rank 0 (it is summed)."""

    def shares(groups: ScoredGroups, n: int) -> list[ScoredGroups]:
        g = groups.rewards.size(1)
        return [select_groups(groups, list(range(r * n, (r + 1) * n)), g) for r in range(world_size)]

    described = shares(sampled.described, len(sampled.described.examples) // world_size)
    kept: list[ScoredGroups | None] = [None] * world_size
    if sampled.groups is not None and len(sampled.groups.examples) >= world_size:
        kept = list(shares(sampled.groups, len(sampled.groups.examples) // world_size))
    zero = torch.zeros_like(sampled.tokens)
    return [
        Sampled(kept[r], described[r], sampled.generate_s, sampled.tokens if r == 0 else zero)
        for r in range(world_size)
    ]
