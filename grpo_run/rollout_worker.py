"""The generation worker of `rollout=async`: a process of its own (torch.multiprocessing, spawn) with its own
torch threads and its own copy of the policy, which samples and scores the coming steps' groups while the
trainer updates, and puts them in a bounded queue (`rollout_source.AsyncRollouts` reads it).

Batch s is sampled exactly as the synchronous loop samples step s: the same PromptSampler (started from the
trainer's position), the same noise seeds (seed, s, prompt index), the same generation engine and scorer.
Under `rollout.lockstep` its weights are those after trainer step max(origin, s - 1 - max_staleness), so a
run is reproducible (and a resume from a checkpoint continues it exactly); each batch carries that version
and the behaviour policy's log-probs of the sampled tokens (the trainer's own forward on the worker's
weights), from which the update corrects a stale batch.

Under `rollout.eval_on=worker|shared` the worker also runs the held-out evaluation: each version due for
one (`WorkerSpec.eval_steps`) is evaluated once it has sampled the batches it samples and before any later
weights replace it, while the trainer goes on training; the per-problem results go back on a queue of
their own. An evaluation the trainer shares (`WorkerSpec.eval_shared`, the one before the first step and
the one after the last) takes only the worker's part of the problems (evaluation.trainer_share).
"""

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
from grpo_run.config.schema import Config, GenerationEngineKind
from grpo_run.data import Example, PromptSampler
from grpo_run.data.prompts import chat_prompts
from grpo_run.engine.weight_channel import WORKER, WeightChannel, pack
from grpo_run.envs.registry import build_environment
from grpo_run.evaluation import HeldOutSets, SetResult, evaluate_share, set_sizes, trainer_share
from grpo_run.models.loading import load_model
from grpo_run.rollout.generate import Rollout
from grpo_run.rollout.groups import Sampled, sample_groups
from grpo_run.rollout_placement import CPU, tensors_to
from grpo_run.scoring.run_scorer import RunScorer, reward_pool
from grpo_run.update import old_and_reference_logprobs

# How often a blocked worker looks at the stop event and for new weights (free-running).
POLL_S = 0.2
# The key of the trainer's store under which the worker says it is about to join the weight group.
READY_KEY = "generation_worker_ready"


@dataclass
class WorkerSpec:
    """What the worker is started with (pickled into the spawned process)."""

    cfg: Config
    tokenizer: PreTrainedTokenizerBase
    examples: list[Example]  # the training split, as the trainer's sampler holds it
    sampler_state: dict[str, Any]  # the trainer's sampler after its last trained step
    start_step: int  # the trainer's last finished step
    port: int  # the trainer's rendezvous store
    # The lockstep rule's first step (rollout_source.lockstep_version): start_step, or, resuming from a
    # checkpoint that holds the weights of the batches in flight, the interrupted run's; those weights
    # come first, then the start weights.
    origin: int
    # Where the worker runs, as it numbers its devices (a GPU worker sees its one GPU as cuda:0), and the
    # weight channel's backend both sides agreed on (weight_channel.channel_backend).
    device: str
    channel_backend: str
    # The dtype of each tensor a sync sends (rollout_source.sync_tensors order): the worker's copy takes
    # them, since the flat buffers split by dtype (DeepSpeed's bf16 mode trains bf16 weights on a GPU).
    dtypes: tuple[torch.dtype, ...]
    # rollout.eval_on=worker|shared: the versions to evaluate and the held-out sets (evaluation.held_out_sets).
    eval_steps: tuple[int, ...] = ()
    eval_sets: HeldOutSets | None = None
    # rollout.eval_on=shared: those of eval_steps whose problems the trainer splits with the worker.
    eval_shared: tuple[int, ...] = ()


@dataclass
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


@dataclass
class Evaluating:
    """On the evaluation queue when the worker starts evaluating version `step`: it is busy, not silent."""

    step: int


@dataclass
class Evaluated:
    """The held-out evaluation of the weights after trainer step `step` (the worker's share of it, when the
    trainer shares it)."""

    step: int
    results: dict[str, SetResult]  # set name -> its per-problem results (evaluation.summarize_sets)


# `waiting`'s value while the worker works, and once it has nothing left to make but waits to be stopped.
BUSY = -1
DONE = 2**62


def run_worker(spec: WorkerSpec, queue, stop, evals=None, waiting=None) -> None:
    """The process's entry point: build, then produce batches until stopped; an error goes to the queue.
    `waiting` (a shared integer, rollout.lend_threads): the weight version the worker holds while it is
    blocked waiting for a newer one, BUSY while it works (rollout_source.AsyncRollouts.borrowed_threads)."""
    die_with_parent()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)  # the trainer stops the run, saves, then stops this process
    torch.set_num_threads(spec.cfg.rollout.threads)
    try:
        Worker(spec, queue, stop, evals, waiting).run()
    except BaseException as err:  # noqa: BLE001 - said to the trainer, which ends the run
        detail = "".join(traceback.format_exception(err)).rstrip()
        message = f"{type(err).__name__}: {err}\n{detail}"
        try:  # the evaluation queue is unbounded: a full batch queue never holds the error back
            (evals or queue).put(WorkerFailed(message), timeout=5.0)
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


def behaviour_logprobs(rollout: Rollout, *, forward, model, micro_batch_size: int) -> torch.Tensor:
    """log pi_behaviour of each sampled token [N, T] (0 past the completion mask), by the trainer's
    forward on the sampling weights."""
    lp, _ = old_and_reference_logprobs(
        rollout, forward=forward, old=model, reference=None, micro_batch_size=micro_batch_size
    )
    return lp * rollout.completion_mask  # [N, T]


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
    def __init__(self, spec: WorkerSpec, queue, stop, evals=None, waiting=None) -> None:
        cfg = self.cfg = spec.cfg
        self.spec, self.queue, self.stop, self.evals = spec, queue, stop, evals
        self.waiting = waiting
        self.eval_steps = set(spec.eval_steps) if spec.eval_sets is not None else set()
        self.device = torch.device(spec.device)
        # Weights that require grad let autocast keep its bf16 casts for the decode loop (as mode=eval).
        self.model = load_model(cfg.model, self.device, trainable=True)
        params = [p for _, p in self.model.named_parameters()]  # tied weights once, as the trainer sends
        match_dtypes(params, spec.dtypes)
        self.flats = pack(params)  # each sync lands in the parameters themselves
        # generation=vllm: the worker's own engine, synced from this copy by vLLM's weight-update path
        # after each receive; its default max_model_len fits the training prompts.
        vllm = cfg.generation.engine == GenerationEngineKind.VLLM
        prompts = self.engine_prompts() if vllm else []
        # The local decoder reports the log-probs it samples with, unless they are to be recomputed.
        report = not cfg.rollout.recompute_behaviour_logprobs
        self.engine = backend.generation_engine(
            cfg, self.model, spec.tokenizer, prompts=prompts, report_logprobs=report
        )
        self.forward = backend.training_forward(cfg, self.device)
        t = cfg.trainer
        self.sampler = PromptSampler(
            spec.examples, seed=cfg.data.seed + t.seed, batch_size=t.prompts_per_step
        )
        self.sampler.load_state_dict(spec.sampler_state)
        self.rewards = RunScorer(cfg.reward, reward_pool(cfg.reward), report_errors=True)
        self.environment = build_environment(cfg.env)  # env != single_turn: the episodes' environment
        self.channel = WeightChannel(
            WORKER,
            port=spec.port,
            timeout_s=cfg.rollout.timeout_s,
            ready_key=READY_KEY,
            backend=spec.channel_backend,
            device=self.device,
        )
        self.version = -1

    def engine_prompts(self) -> list[str]:
        """The prompts a vLLM engine sizes its context for: the training split's, and the held-out sets'
        it evaluates (their first eval.num_prompts, as evaluation samples them)."""
        spec = self.spec
        prompts = chat_prompts(spec.tokenizer, self.cfg.data, spec.examples)
        for cfg, examples in (spec.eval_sets or {}).values():
            prompts += chat_prompts(spec.tokenizer, cfg.data, examples[: cfg.eval.num_prompts])
        return prompts

    def receive(self) -> float:
        """The next sync's weights into the policy copy; seconds spent waiting for and copying them. The
        weights they replace are evaluated first if due (not counted): only now, so that the batches those
        weights sample, which the trainer waits for, came before the evaluation."""
        if self.version in self.eval_steps:
            self.evaluate(self.version)
        t = time.perf_counter()
        # Blocked until the trainer sends a version newer than this one (not always the next: lockstep
        # skips those that sample nothing): its update may run on this worker's threads meanwhile.
        self.say_waiting(self.version)
        try:
            version = self.channel.receive(self.flats)
        finally:
            self.say_waiting(BUSY)
        if version <= self.version:
            raise RuntimeError(f"weight sync went from version {self.version} to {version}")
        self.version = version
        self.engine.policy_updated()
        return time.perf_counter() - t

    def say_waiting(self, version: int) -> None:
        if self.waiting is not None:
            self.waiting.value = version

    def evaluate(self, step: int) -> None:
        self.evals.put(Evaluating(step))
        sets = self.spec.eval_sets
        share = None  # all of it
        if step in self.spec.eval_shared:  # the trainer evaluates the first part itself
            share = trainer_share(set_sizes(sets), self.cfg.eval.batch_size)[1]
        results = evaluate_share(
            sets, share, self.spec.tokenizer, self.rewards.pool, self.device, self.engine, self.environment
        )
        self.eval_steps.discard(step)
        self.evals.put(Evaluated(step, results))

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
            # Lockstep: every batch is made; the trainer still sends the last versions due for evaluation.
            while self.eval_steps and not self.stop.is_set():
                if self.version in self.eval_steps:
                    self.evaluate(self.version)
                else:
                    self.receive()
            self.say_waiting(DONE)
            self.stop.wait()  # the trainer ends the process
        finally:
            self.rewards.close()
            self.engine.close()

    def lockstep_version(self, step: int) -> int:
        return lockstep_version(step, origin=self.spec.origin, max_staleness=self.cfg.rollout.max_staleness)

    def produce(self, step: int, wait_s: float) -> Produced:
        t0 = time.perf_counter()
        stats = M.StepMetrics(self.device)
        sampled = sample_groups(
            step,
            stats,
            self.cfg,
            sampler=self.sampler,
            generation=self.engine,
            tokenizer=self.spec.tokenizer,
            rewards=self.rewards,
            rank=0,
            world_size=1,
            device=self.device,
            environment=self.environment,
        )
        rollout = sampled.described.rollout  # the kept groups' rollout too, when there are any
        # Recomputed (or not reported: multi-turn episodes on the native decoder's cached turns): the
        # trainer's forward on these weights.
        if rollout.sampler_logprobs is None:
            rollout.sampler_logprobs = behaviour_logprobs(
                rollout,
                forward=self.forward,
                model=self.model,
                micro_batch_size=self.cfg.trainer.micro_batch_size,
            )  # else vLLM's own log-probs: the behaviour policy is the engine that sampled
        rollout.policy_version = torch.full((rollout.completion_ids.size(0),), self.version, dtype=torch.long)
        # Through the queue on the CPU: the trainer numbers the GPUs otherwise (rollout_placement).
        return Produced(
            step,
            self.version,
            tensors_to(sampled, CPU),
            tensors_to(stats.parts(), CPU),
            self.sampler.state_dict(),
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
                    item.wait_s += self.receive()
