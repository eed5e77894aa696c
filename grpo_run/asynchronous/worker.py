"""The generation worker of `rollout=async`: a process of its own (torch.multiprocessing, spawn) with its own
torch threads and its own copy of the policy, which samples and scores the coming steps' groups while the
trainer updates, and puts them in a bounded queue (`source.AsyncRollouts` reads it).

Batch s is sampled exactly as the synchronous loop samples step s: the same PromptSampler (started from the
trainer's position), the same noise seeds (seed, s, prompt index), the same generation engine and scorer
(`rollout.groups.sample_groups` on a `GroupSampler` of its own). Under `rollout.lockstep` its weights are
those after trainer step max(start, s - 1 - max_staleness), so a run is reproducible. Each batch is handed
over as it was built, never changed after: a batch sampled by the very weights its step trains, by an
engine whose samples count as on-policy (`EngineCapabilities.on_policy`), is the synchronous loop's
batch; any other carries its policy version and the behaviour policy's log-probs of the sampled tokens
(the engine's own, or the training forward on the sampling weights), from which the update corrects it.
"""

import dataclasses
import multiprocessing
import multiprocessing.connection
import os
import queue as queue_errors
import signal
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from grpo_run import backend
from grpo_run import metrics as M
from grpo_run.asynchronous.placement import CPU, tensors_to
from grpo_run.asynchronous.weight_channel import WORKER, WeightChannel, pack
from grpo_run.config.schema import Config
from grpo_run.data import Example, PromptSampler
from grpo_run.envs.registry import build_environment
from grpo_run.models.loading import load_model
from grpo_run.passes import behaviour_logprobs
from grpo_run.rollout.groups import GroupSampler, Sampled, sample_groups
from grpo_run.safety.stop import follow
from grpo_run.scoring.run_scorer import run_scorer

# How often a blocked worker looks at the stop event and for new weights (free-running).
POLL_S = 0.2
# How often a worker waiting for weights asks the trainer's store whether they are on their way (short: at
# max_staleness=0 every step waits here).
RECEIVE_POLL_S = 0.005
# The key of the trainer's store under which the worker says it is about to join the weight group.
READY_KEY = "generation_worker_ready"


@dataclass
class WorkerSpec:
    """What the worker is started with (pickled into the spawned process)."""

    cfg: Config
    tokenizer: PreTrainedTokenizerBase
    examples: list[Example]  # the training split, as the trainer's sampler holds it
    sampler_state: dict[str, Any]  # the trainer's sampler after its last trained step
    start_step: int  # the trainer's last finished step: the lockstep rule's origin
    port: int  # the trainer's rendezvous store
    # Where the worker runs, as it numbers its devices (a GPU worker sees its one GPU as cuda:0), and the
    # weight channel's backend both sides agreed on (weight_channel.channel_backend).
    device: str
    channel_backend: str
    # The dtype of each tensor a sync sends (weight_channel.sync_tensors order): the worker's copy takes
    # them, since the flat buffers split by dtype (DeepSpeed's bf16 mode trains bf16 weights on a GPU).
    dtypes: tuple[torch.dtype, ...]


@dataclass(frozen=True)
class Produced:
    """One batch of scored groups, as it goes through the queue (its tensors on the CPU)."""

    step: int  # the step whose prompts and seeds it holds (its batch index)
    version: int  # the trainer step whose weights sampled it
    sampled: Sampled
    stats: tuple  # the worker's StepMetrics.parts(): reward failures, dropped groups, rounds
    sampler_state: dict[str, Any]  # the sampler after this batch: what a checkpoint after it holds
    generate_s: float  # generation, scoring and the behaviour log-probs
    wait_s: float  # idle before it: waiting for weights


@dataclass
class WorkerFailed:
    message: str


class Stopped(Exception):
    """The trainer stopped the run while the worker waited for weights."""


def run_worker(spec: WorkerSpec, queue, stop, failures) -> None:
    """The process's entry point: build, then produce batches until stopped; an error goes to `failures`."""
    die_with_parent()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)  # the trainer stops the run, saves, then stops this process
    follow(stop)  # set by the trainer's stop signal: the decode loop and the reward calls end early
    torch.set_num_threads(spec.cfg.rollout.threads)
    try:
        Worker(spec, queue, stop).run()
    except BaseException as err:  # noqa: BLE001 - said to the trainer, which ends the run
        detail = "".join(traceback.format_exception(err)).rstrip()
        try:
            failures.put(WorkerFailed(f"{type(err).__name__}: {err}\n{detail}"), timeout=5.0)
        except queue_errors.Full:
            pass
        raise SystemExit(1) from None


def lockstep_version(step: int, *, origin: int, max_staleness: int) -> int:
    """rollout.lockstep: the trainer step whose weights sample batch `step` in a run whose first trained
    step was origin + 1 (the start weights until then)."""
    return max(origin, step - 1 - max_staleness)


def die_with_parent() -> None:
    """Exit as soon as the trainer does, even after a SIGKILL (the parent sentinel closes)."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="watch-trainer").start()


def match_dtypes(params: list[torch.nn.Parameter], dtypes: tuple[torch.dtype, ...]) -> None:
    """Cast the worker's parameters to the trainer's dtypes, one by one (a tied weight is one parameter)."""
    if len(params) != len(dtypes):
        raise RuntimeError(
            f"the trainer sends {len(dtypes)} tensors per weight sync, the worker's model has {len(params)}"
        )
    for p, dtype in zip(params, dtypes, strict=True):
        if p.dtype != dtype:
            p.data = p.data.to(dtype)


class Worker:
    def __init__(self, spec: WorkerSpec, queue, stop) -> None:
        cfg = self.cfg = spec.cfg
        self.spec, self.queue, self.stop = spec, queue, stop
        self.device = torch.device(spec.device)
        # Weights that require grad let autocast keep its bf16 casts for the decode loop (as mode=eval).
        self.model = load_model(cfg.model, self.device, trainable=True)
        params = [p for _, p in self.model.named_parameters()]  # tied weights once, as the trainer sends
        match_dtypes(params, spec.dtypes)
        self.flats = pack(params)  # each sync lands in the parameters themselves
        # The local decoder reports the log-probs it samples with, unless they are to be recomputed.
        engine = backend.sampling_engine(
            cfg,
            self.model,
            spec.tokenizer,
            spec.examples,
            backend.SamplingRole(report_logprobs=not cfg.rollout.recompute_behaviour_logprobs),
        )
        self.on_policy_engine = engine.CAPABILITIES.on_policy
        t = cfg.trainer
        sampler = PromptSampler(spec.examples, seed=cfg.data.seed + t.seed, batch_size=t.prompts_per_step)
        sampler.load_state_dict(spec.sampler_state)
        self.side = GroupSampler(
            cfg,
            sampler=sampler,
            generation=engine,
            tokenizer=spec.tokenizer,
            rewards=run_scorer(cfg, len(spec.examples), report_errors=True),
            device=self.device,
            environment=build_environment(cfg.env),  # env != single_turn: the episodes' environment
        )
        self.forward = backend.training_forward(cfg, self.device)
        self.channel = WeightChannel(
            WORKER,
            port=spec.port,
            timeout_s=cfg.rollout.timeout_s,
            ready_key=READY_KEY,
            backend=spec.channel_backend,
            device=self.device,
        )
        self.version = -1

    def receive(self) -> float:
        """The next sync's weights into the policy copy; seconds spent waiting for and copying them.
        Raises Stopped when the trainer stops the run meanwhile."""
        t = time.perf_counter()
        # Until the trainer sends a version newer than this one (not always the next: lockstep skips those
        # that sample nothing). Polled, not a blocking receive: the trainer may evaluate, or checkpoint,
        # for longer than the channel's timeout before it sends, and that is no fault.
        while not self.channel.sent_after(self.version):
            if self.stop.is_set():
                raise Stopped
            time.sleep(RECEIVE_POLL_S)
        version = self.channel.receive(self.flats)
        if version <= self.version:
            raise RuntimeError(f"weight sync went from version {self.version} to {version}")
        self.version = version
        self.side.generation.policy_updated()
        return time.perf_counter() - t

    def run(self) -> None:
        r, t = self.cfg.rollout, self.cfg.trainer
        try:
            step = self.spec.start_step + 1
            self.receive()
            first = self.lockstep_version(step) if r.lockstep else self.spec.start_step
            if self.version != first:
                raise RuntimeError(f"the first weights are version {self.version}, not {first}")
            while not self.stop.is_set() and (step <= t.max_steps or not r.lockstep):
                wait = 0.0
                if r.lockstep:  # exactly the weights after step s - 1 - k
                    while self.version < self.lockstep_version(step):
                        wait += self.receive()
                else:  # the newest weights sent so far
                    while self.channel.latest() > self.version:
                        wait += self.receive()
                self.put(self.produce(step, wait))
                step += 1
            self.stop.wait()  # every batch is made: the trainer ends the process
        except Stopped:
            pass
        finally:
            self.side.rewards.close()
            self.side.generation.close()

    def lockstep_version(self, step: int) -> int:
        return lockstep_version(
            step, origin=self.spec.start_step, max_staleness=self.cfg.rollout.max_staleness
        )

    def on_policy(self, step: int) -> bool:
        """Whether batch `step` is the synchronous loop's: lockstep (so its step trains exactly the
        weights after step - 1) and sampled by those very weights, by an engine whose samples count as
        on-policy. Free-running batches always carry their behaviour log-probs: their lag is known only
        when the trainer takes them."""
        lockstep = self.cfg.rollout.lockstep
        return lockstep and self.on_policy_engine and self.version == step - 1

    def produce(self, step: int, wait_s: float) -> Produced:
        t0 = time.perf_counter()
        stats = M.StepMetrics(self.device)
        sampled = sample_groups(step, stats, self.side)
        if self.stop.is_set():  # cut short by the trainer's stop: nobody trains on it
            raise Stopped
        rollout = sampled.described.rollout  # the kept groups' rollout too, when there are any
        if self.on_policy(step):  # the update recomputes pi_old, as the synchronous loop does
            rollout = dataclasses.replace(rollout, sampler_logprobs=None, policy_version=None)
        else:
            behaviour = rollout.sampler_logprobs  # the engine's own (vLLM's: the engine that sampled)
            if behaviour is None:  # recomputed, or not reported (multi-turn on the native cached turns)
                behaviour = behaviour_logprobs(
                    rollout,
                    forward=self.forward,
                    model=self.model,
                    micro_batch_size=self.cfg.trainer.micro_batch_size,
                )
            version = torch.full((rollout.completion_ids.size(0),), self.version, dtype=torch.long)
            rollout = dataclasses.replace(rollout, sampler_logprobs=behaviour, policy_version=version)
        described = dataclasses.replace(sampled.described, rollout=rollout)
        handed = Sampled(described if sampled.groups is not None else None, described, *sampled[2:])
        # Through the queue on the CPU: the trainer numbers the GPUs otherwise (placement.py).
        return Produced(
            step,
            self.version,
            tensors_to(handed, CPU),
            tensors_to(stats.parts(), CPU),
            self.side.sampler.state_dict(),
            time.perf_counter() - t0,
            wait_s,
        )

    def put(self, item: Produced) -> None:
        """Into the queue once there is room; while it is full a free-running worker takes new weights."""
        while not self.stop.is_set():
            try:
                self.queue.put(item, timeout=POLL_S)
                return
            except queue_errors.Full:
                if not self.cfg.rollout.lockstep and self.channel.latest() > self.version:
                    item = dataclasses.replace(item, wait_s=item.wait_s + self.receive())
