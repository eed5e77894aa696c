"""Where a step's scored groups come from: the one protocol the loop calls, chosen by the `rollout` group.

SyncRollouts   rollout=sync   the trainer samples and scores the step's groups itself (rollout/groups.py)
AsyncRollouts  rollout=async  a generation worker process (rollout_worker.py) samples ahead; the trainer
                              takes its batches from a bounded queue and sends it the weights after
                              every step (engine/weight_channel.py), on the device `rollout.device`
                              names (rollout_placement.py)
"""

import os
import queue as queue_errors
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from grpo_run import metrics as M
from grpo_run.config.schema import Config, GenerationEngineKind, RolloutMode
from grpo_run.data import Example, PromptSampler
from grpo_run.engine.weight_channel import flatten
from grpo_run.evaluation import HeldOutSets, SetResult
from grpo_run.rollout.engines import GenerationEngine
from grpo_run.rollout.groups import Sampled, ScoredGroups, sample_groups, select_groups
from grpo_run.rollout_placement import (
    CPU,
    VISIBLE,
    own_device,
    spawn_environment,
    tensors_to,
    training_gpus,
    worker_device,
    worker_environment,
)
from grpo_run.rollout_worker import lockstep_version
from grpo_run.scoring.run_scorer import RunScorer
from grpo_run.tracking import console

if TYPE_CHECKING:
    from grpo_run.envs.base import Environment
    from grpo_run.models.lora import LoraPolicy

# How often a trainer waiting for groups looks whether the worker is still alive.
POLL_S = 0.5
# How long a stopped worker gets to exit before it is killed.
STOP_GRACE_S = 5.0
# How often the trainer looks whether the previous weight sync is done (short: it is on the step's path).
SYNC_POLL_S = 0.002


class RolloutSource(Protocol):
    def sample(self, step: int, stats: M.StepMetrics) -> Sampled:
        """The scored groups step `step` trains on (its reward failures counted into `stats`)."""
        ...

    def trained(self, step: int, stats: M.StepMetrics) -> None:
        """Step `step`'s optimizer steps are done: the weights are version `step`."""
        ...

    def checkpoint_files(self, step: int) -> dict[str, dict[str, torch.Tensor]]:
        """Files (name -> tensors) a checkpoint after step `step` needs so that a resume samples the
        coming batches exactly as this run would have; empty when the checkpoint's own state is enough."""
        ...

    def borrowed_threads(self, step: int, chunk: int, chunks: int) -> int:
        """The torch threads the generation side lends micro-batch `chunk` (0-based) of the `chunks` of
        step `step`'s update, on top of the trainer's own (0: none); it may wait until they are idle."""
        ...

    def close(self) -> None: ...


def lent_from(chunks: int) -> int | None:
    """rollout.lend_threads: the first micro-batch of an update of `chunks` that runs on the worker's threads
    too: the second half (3 -> 1, 4 -> 2), by which time the worker has usually made its next batch; None
    for a single micro-batch. A fixed index, not the moment the worker goes idle: the kernels may round
    differently on another thread count, and the same run must give the same numbers."""
    return chunks // 2 if chunks >= 2 else None


def worker_blocked(waiting: int, last_sent: int) -> bool:
    """Whether a worker that says it waits holding version `waiting` (rollout_worker.BUSY: it works) is
    blocked until the trainer sends again: nothing newer than it holds was sent (`last_sent`). Worker
    holding 4, trainer sent 4: blocked; holding 3, sent 4: version 4 is on its way, it samples again."""
    return waiting >= last_sent


def lends_threads(cfg: Config, trainer: torch.device, worker: torch.device, worker_alone: set[int]) -> bool:
    """Whether the generation worker lends its threads to the update (rollout.lend_threads): both sides on
    the CPU, lockstep (a free-running worker is never idle for long), one step off or more (at 0 the run
    is the synchronous loop's, on its thread count), and no evaluation the worker runs alone (`worker_alone`:
    the update would wait through it). One training rank: RankShares lends nothing."""
    r = cfg.rollout
    cpu = trainer.type == "cpu" and worker.type == "cpu"
    return r.lend_threads and cpu and r.lockstep and r.max_staleness >= 1 and not worker_alone


@runtime_checkable
class WorkerEvaluations(Protocol):
    """A source whose generation worker also runs the held-out evaluation (rollout.eval_on=worker|shared)."""

    def evaluations(self, steps: set[int], *, wait: bool) -> dict[int, dict[str, SetResult]]:
        """step -> (set name -> per-problem results: the worker's share of a shared evaluation) of those of
        `steps` the worker has evaluated so far; with wait, of all of them."""
        ...


class SyncRollouts:
    """rollout=sync: the step's groups from the trainer's own generation engine, as the loop always did."""

    def __init__(
        self,
        cfg: Config,
        *,
        sampler: PromptSampler,
        generation: GenerationEngine,
        tokenizer: PreTrainedTokenizerBase,
        rewards: RunScorer,
        rank: int,
        world_size: int,
        device: torch.device,
        environment: "Environment | None" = None,
        ranks_max: Callable[[torch.Tensor], torch.Tensor] = lambda x: x,
    ) -> None:
        self.cfg, self.sampler, self.generation, self.tokenizer = cfg, sampler, generation, tokenizer
        self.rewards, self.rank, self.world_size, self.device = rewards, rank, world_size, device
        self.environment = environment
        self.ranks_max = ranks_max  # dynamic sampling's agreement between ranks (`sample_groups`)

    def sample(self, step: int, stats: M.StepMetrics) -> Sampled:
        return sample_groups(
            step,
            stats,
            self.cfg,
            sampler=self.sampler,
            generation=self.generation,
            tokenizer=self.tokenizer,
            rewards=self.rewards,
            rank=self.rank,
            world_size=self.world_size,
            device=self.device,
            environment=self.environment,
            ranks_max=self.ranks_max,
        )

    def trained(self, step: int, stats: M.StepMetrics) -> None:
        pass  # the engine itself was told after each optimizer step (GenerationEngine.policy_updated)

    def checkpoint_files(self, step: int) -> dict[str, dict[str, torch.Tensor]]:
        return {}  # the next batch is sampled by the checkpoint's own weights

    def borrowed_threads(self, step: int, chunk: int, chunks: int) -> int:
        return 0  # generation and the update take turns on the same threads

    def close(self) -> None:
        pass  # the engine and the scorer belong to the run context


class RolloutWorkerError(RuntimeError):
    """The generation worker died, failed or went silent; the run ends (exit 1) after saving what it trained."""

    def __init__(self, message: str, detail: str = "") -> None:
        super().__init__(message)
        self.detail = detail or message


def sync_tensors(policy: torch.nn.Module, lora: bool) -> list[torch.Tensor]:
    """The tensors a plain copy of the policy is made of, in its `named_parameters` order, tied weights once;
    with LoRA the adapters merged into the projections they adapt (as the vLLM sync sends them)."""
    if lora:
        from grpo_run.models.lora import merged_named_parameters

        named = merged_named_parameters(policy)
    else:
        named = [(n, p.detach()) for n, p in policy.named_parameters(remove_duplicate=False)]
    seen, out = set(), []
    for _, t in named:
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            out.append(t)
    return out


def unneeded(kept: Iterable[int], version: int, max_staleness: int) -> list[int]:
    """The kept versions no checkpoint needs once `version` is kept, oldest first: all but the last
    max_staleness + 1 (e.g. kept {3, 4}, version 5, k = 1 -> [3])."""
    return sorted(v for v in kept if v < version - max_staleness)


def staleness(step: int, version: int) -> int:
    """Steps between the weights that sampled a batch and those step `step` trains (version step - 1)."""
    return step - 1 - version


# A checkpoint's copy of the weights the batches after it are sampled with (rollout=async, lockstep):
# `meta` = [origin, max_staleness], `v<version>.<i>` = that version's flat buffer i (weight_channel.flatten).
IN_FLIGHT_FILE = "rollout_weights.safetensors"


def in_flight_weights(files: dict[str, torch.Tensor]) -> tuple[int, int, dict[int, list[torch.Tensor]]]:
    """(origin, max_staleness, version -> flat buffers) of an IN_FLIGHT_FILE's tensors."""
    origin, k = (int(x) for x in files["meta"].tolist())
    versions: dict[int, dict[int, torch.Tensor]] = {}
    for key, tensor in files.items():
        if key != "meta":
            version, index = key[1:].split(".")
            versions.setdefault(int(version), {})[int(index)] = tensor
    # Copies: the trainer later flattens newer versions over these buffers, and load_file may map the file.
    return origin, k, {v: [b[i].clone() for i in sorted(b)] for v, b in sorted(versions.items())}


class AsyncRollouts:
    """rollout=async: batches from the generation worker; each batch's staleness is checked and logged."""

    def __init__(
        self,
        cfg: Config,
        *,
        policy: PreTrainedModel,
        lora: "LoraPolicy | None",
        tokenizer: PreTrainedTokenizerBase,
        examples: Sequence[Example],
        sampler: PromptSampler,
        start_step: int,
        device: torch.device,
        in_flight: dict[str, torch.Tensor] | None = None,
        eval_sets: HeldOutSets | None = None,
        eval_steps: Sequence[int] = (),
        eval_shared: Sequence[int] = (),
    ) -> None:
        """`device`: where `sample` hands the batches over. `in_flight`: the resumed checkpoint's
        IN_FLIGHT_FILE, if it has one. `eval_sets`, `eval_steps`: the held-out sets the worker evaluates
        the weights of `eval_steps` on (rollout.eval_on=worker|shared); `eval_shared`: those of them whose
        first part the trainer evaluates itself (evaluation.shared_steps)."""
        from grpo_run.engine.weight_channel import TRAINER, WeightChannel, channel_backend, joined, open_store
        from grpo_run.rollout_worker import BUSY, READY_KEY, WorkerSpec, run_worker

        self.cfg, self.policy, self.lora, self.sampler = cfg, policy, lora is not None, sampler
        self.device = device
        r = cfg.rollout
        trainer, worker = self._placement()
        backend = channel_backend(trainer, worker)
        self.origin, earlier = self._resumed_versions(start_step, in_flight)
        # The weights sent lately, version -> flat buffers on the CPU, kept until no checkpoint can need
        # them (k + 1 copies of the weights: on a GPU trainer they would take its memory).
        self.sent: dict[int, list[torch.Tensor]] = {}
        mp = torch.multiprocessing.get_context("spawn")
        store, port = open_store(r.timeout_s)
        # lockstep: the worker is at most max_staleness batches ahead of the one the trainer waits for.
        self.queue = mp.Queue(maxsize=r.max_staleness + 1)
        self.stop = mp.Event()
        # The version the worker holds while it is blocked waiting for a newer one (BUSY while it works),
        # and the newest version sent to it.
        self.waiting = mp.Value("q", BUSY, lock=False)
        self.last_sent = -1
        # The worker's evaluations and its last error (unbounded: a full batch queue never hides it).
        self.evals = mp.Queue()
        self.eval_steps = set(eval_steps) if eval_sets is not None else set()
        self.lends = lends_threads(cfg, trainer, worker, self.eval_steps - set(eval_shared))
        self.lent, self.lend_wait_s = 0, 0.0  # this step's: threads lent, the wait for them
        self.evaluated: dict[int, dict[str, SetResult]] = {}
        spec = WorkerSpec(
            cfg,
            tokenizer,
            list(examples),
            sampler.state_dict(),
            start_step,
            port,
            origin=self.origin,
            eval_steps=tuple(sorted(self.eval_steps)),
            eval_sets=eval_sets,
            eval_shared=tuple(sorted(set(eval_shared) & self.eval_steps)),
            device=str(own_device(worker)),
            channel_backend=backend,
            dtypes=tuple(t.dtype for t in sync_tensors(policy, self.lora)),
        )
        self.process = mp.Process(
            target=run_worker,
            args=(spec, self.queue, self.stop, self.evals, self.waiting),
            name="grpo-run-generation",
        )
        # The worker sees its GPU alone (as cuda:0), from before its first import to vLLM's engine.
        with spawn_environment(worker_environment(worker, os.environ.get(VISIBLE))):
            self.process.start()
        console.print(
            f"rollout=async: generation worker pid {self.process.pid} on {worker} (weights over {backend}), "
            f"{r.threads} thread(s), max_staleness={r.max_staleness}, lockstep={r.lockstep}"
            + (", lent to the update's second half once idle" if self.lends else ""),
            soft_wrap=True,
            markup=False,
            highlight=False,
        )
        self.channel = None
        deadline = time.monotonic() + r.timeout_s
        while not joined(store, READY_KEY):  # the worker loads its model first
            self._check_alive("starting")
            if time.monotonic() > deadline:
                raise RolloutWorkerError(self._silent("start"))
            time.sleep(0.05)
        self.channel = WeightChannel(
            TRAINER, port=port, timeout_s=r.timeout_s, store=store, backend=backend, device=trainer
        )
        for version, buffers in earlier.items():  # the interrupted run's weights for the batches in flight
            self._send(version, buffers)
        self._send(start_step, flatten(sync_tensors(policy, self.lora)))

    def _placement(self) -> tuple[torch.device, torch.device]:
        """(the trainer's device, the worker's) in this process's numbering of the GPUs; a ConfigError for
        a rollout.device this node cannot serve, before anything starts."""
        trainer = next(self.policy.parameters()).device
        gpus = torch.cuda.device_count()
        return trainer, worker_device(self.cfg.rollout.device, trainer, training_gpus(self.cfg), gpus)

    def _resumed_versions(
        self, start: int, in_flight: dict[str, torch.Tensor] | None
    ) -> tuple[int, dict[int, list[torch.Tensor]]]:
        """(origin of the lockstep rule, the earlier versions to send before the start weights).

        Lockstep samples batches start+1 .. start+k with versions older than the checkpoint's weights; a
        checkpoint that holds them (same max_staleness) lets the resumed run sample them exactly as the
        interrupted one would have. Without them the worker starts from the checkpoint's weights: the same
        prompts and seeds, fresher weights for the first k steps."""
        r = self.cfg.rollout
        if not r.lockstep or in_flight is None:
            return start, {}
        origin, k, versions = in_flight_weights(in_flight)
        wanted = list(range(lockstep_version(start + 1, origin=origin, max_staleness=k), start))
        if k == r.max_staleness and list(versions) == wanted:
            return origin, versions
        console.print(
            f"rollout=async: the checkpoint's in-flight weights were saved with max_staleness={k}, now "
            f"{r.max_staleness}: the next batches are sampled with the checkpoint's own weights",
            soft_wrap=True,
            markup=False,
            highlight=False,
        )
        return start, {}

    def _send(self, version: int, buffers: list[torch.Tensor]) -> None:
        kept = self._keep(version, buffers)
        self._await_sync()
        self.last_sent = version
        # gloo sends the kept host copies (no second device-to-host copy); NCCL the buffers on the GPU.
        self.channel.send(version, kept if self.channel.device.type == "cpu" else buffers)

    def _await_sync(self) -> None:
        """Until the previous sync has reached the worker, watching it: a worker that died meanwhile ends
        the run as in a wait for a batch. Under NCCL a sync the worker never takes would otherwise hold
        the trainer's GPU stream until NCCL's watchdog ends the whole process, with nothing saved."""
        deadline = time.monotonic() + self.cfg.rollout.timeout_s
        while not self.channel.done():
            self._check_alive("receiving weights")
            if time.monotonic() > deadline:
                raise RolloutWorkerError(self._silent("receive the weights"))
            time.sleep(SYNC_POLL_S)

    def _keep(self, version: int, buffers: list[torch.Tensor]) -> list[torch.Tensor]:
        """Hold the last max_staleness + 1 versions, on the CPU: what a checkpoint after this step, or one
        of the state before the next step (a step that could not be scored), needs (`checkpoint_files`).
        A GPU trainer copies each version to the host here, once per step (CPU buffers stay as they are)."""
        kept = [b.cpu() for b in buffers]
        self.sent[version] = kept
        for old in unneeded(self.sent, version, self.cfg.rollout.max_staleness):
            del self.sent[old]
        return kept

    def _spare(self, version: int) -> list[torch.Tensor] | None:
        """The buffers of a version that keeping `version` drops, for its flatten to write over (None
        when there is none yet); if the sync in flight still reads them, once it has reached the worker."""
        old = unneeded(self.sent, version, self.cfg.rollout.max_staleness)
        if not old:
            return None
        buffers = self.sent.pop(old[0])
        if self.channel is not None and self.channel.sending(buffers):  # max_staleness=0: the last sync
            self._await_sync()
        return buffers

    def checkpoint_files(self, step: int) -> dict[str, dict[str, torch.Tensor]]:
        r = self.cfg.rollout
        if not r.lockstep:  # free-running is not reproducible: nothing to reproduce
            return {}
        first = lockstep_version(step + 1, origin=self.origin, max_staleness=r.max_staleness)
        wanted = range(first, step)
        if any(v not in self.sent for v in wanted):
            return {}
        files = {"meta": torch.tensor([self.origin, r.max_staleness], dtype=torch.long)}
        for version in wanted:
            for i, buffer in enumerate(self.sent[version]):
                files[f"v{version}.{i}"] = buffer
        return {IN_FLIGHT_FILE: files}

    def _check_alive(self, doing: str) -> None:
        if self.process.is_alive():
            return
        message = f"the generation worker (pid {self.process.pid}) died while {doing}"
        message += f" with exit code {self.process.exitcode}"
        detail = message
        for source in (self.evals, self.queue):
            try:
                while True:
                    item = source.get(timeout=1.0)
                    if hasattr(item, "message"):  # WorkerFailed: its error and traceback
                        detail = f"{message}: {item.message}"
                        raise RolloutWorkerError(f"{message}: {item.message.splitlines()[0]}", detail)
            except (queue_errors.Empty, EOFError, OSError):
                pass
        raise RolloutWorkerError(message, detail)

    def _silent(self, doing: str) -> str:
        return (
            f"the generation worker (pid {self.process.pid}) did not {doing} within "
            f"rollout.timeout_s={self.cfg.rollout.timeout_s:g} seconds"
        )

    def _next(self):
        from grpo_run.rollout_worker import WorkerFailed

        deadline = time.monotonic() + self.cfg.rollout.timeout_s
        while True:
            try:
                item = self.queue.get(timeout=POLL_S)
            except queue_errors.Empty:
                self._check_alive("generating")
                if self._take_evals():  # an evaluation on the worker delays the batch: not silent
                    deadline = time.monotonic() + self.cfg.rollout.timeout_s
                if time.monotonic() > deadline:
                    raise RolloutWorkerError(self._silent("deliver a batch")) from None
                continue
            except (EOFError, OSError):  # it died while handing a batch's tensors over
                self.process.join(timeout=STOP_GRACE_S)
                self._check_alive("handing over a batch")
                raise RolloutWorkerError(
                    f"the generation worker (pid {self.process.pid}) broke off handing over a batch"
                ) from None
            if isinstance(item, WorkerFailed):
                first = item.message.splitlines()[0]
                raise RolloutWorkerError(
                    f"the generation worker (pid {self.process.pid}) failed: {first}", item.message
                )
            return item

    def _take_evals(self, timeout: float = 0.0) -> bool:
        """Move what the evaluation queue holds into `evaluated` (waiting up to `timeout` for the first);
        whether anything came."""
        from grpo_run.rollout_worker import Evaluated, WorkerFailed

        came = False
        while True:
            try:
                item = (
                    self.evals.get(timeout=timeout) if timeout > 0 and not came else self.evals.get_nowait()
                )
            except (queue_errors.Empty, EOFError, OSError):
                return came
            came = True
            if isinstance(item, WorkerFailed):
                raise RolloutWorkerError(
                    f"the generation worker (pid {self.process.pid}) failed: {item.message.splitlines()[0]}",
                    item.message,
                )
            if isinstance(item, Evaluated):
                self.evaluated[item.step] = item.results

    def evaluations(self, steps: set[int], *, wait: bool) -> dict[int, dict[str, SetResult]]:
        deadline = time.monotonic() + self.cfg.rollout.timeout_s
        self._take_evals()
        while wait and not steps <= self.evaluated.keys():
            if self._take_evals(timeout=POLL_S):  # it started or finished one: not silent
                deadline = time.monotonic() + self.cfg.rollout.timeout_s
                continue
            self._check_alive("evaluating")
            if time.monotonic() > deadline:
                missing = sorted(steps - self.evaluated.keys())
                raise RolloutWorkerError(self._silent(f"deliver the evaluation of step {missing[0]}"))
        return {s: self.evaluated.pop(s) for s in sorted(steps) if s in self.evaluated}

    def sample(self, step: int, stats: M.StepMetrics) -> Sampled:
        k = self.cfg.rollout.max_staleness
        t0 = time.perf_counter()
        dropped = 0
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
        wait = time.perf_counter() - t0
        sampled = tensors_to(item.sampled, self.device)  # the worker hands its batches over on the CPU
        # Sampled by the weights being trained with the local engine: on-policy, the synchronous loop's
        # update. vLLM's log-probs stay, as in sync: they correct the engine's mismatch.
        if lag == 0 and self.cfg.generation.engine == GenerationEngineKind.LOCAL:
            for groups in (sampled.groups, sampled.described):
                if groups is not None:
                    groups.rollout.sampler_logprobs = None
                    groups.rollout.policy_version = None
        stats.merge(item.stats)  # moved to the stats' device there
        stats.add_mean(M.ASYNC_STALENESS_MEAN, float(lag), 1.0)
        stats.add_max(M.ASYNC_STALENESS_MAX, float(lag))
        stats.add_sum(M.ASYNC_DROPPED_STALE, float(dropped))
        stats.set_host(M.ASYNC_TRAINER_WAIT_S, wait)
        stats.set_host(M.ASYNC_GENERATOR_WAIT_S, item.wait_s)
        stats.set_host(M.ASYNC_GENERATE_S, item.generate_s)
        # perf/generate_s: the time this step spent getting its groups (here the wait), so that the
        # step's time still splits into generation, reference and training.
        return Sampled(sampled.groups, sampled.described, wait, sampled.tokens)

    def borrowed_threads(self, step: int, chunk: int, chunks: int) -> int:
        """The worker's threads, from `lent_from(chunks)` on, once it is blocked (`worker_blocked`): nothing
        newer goes to it before this update ends, so it cannot start again while its threads are lent.
        Waits for that here, watching the worker as a wait for a batch does."""
        first = lent_from(chunks)
        if not self.lends or first is None or chunk < first:
            return 0
        t0 = time.perf_counter()
        deadline = time.monotonic() + self.cfg.rollout.timeout_s
        while not worker_blocked(self.waiting.value, self.last_sent):
            self._check_alive("generating")
            if self._take_evals():  # the worker's part of an evaluation delays it: not silent
                deadline = time.monotonic() + self.cfg.rollout.timeout_s
            if time.monotonic() > deadline:
                raise RolloutWorkerError(self._silent(f"make the batch after step {step}'s"))
            time.sleep(SYNC_POLL_S)
        self.lend_wait_s += time.perf_counter() - t0
        self.lent = self.cfg.rollout.threads
        return self.lent

    def trained(self, step: int, stats: M.StepMetrics) -> None:
        if self.lends:
            stats.set_host(M.ASYNC_LENT_THREADS, float(self.lent))
            stats.set_host(M.ASYNC_LEND_WAIT_S, self.lend_wait_s)
            self.lent, self.lend_wait_s = 0, 0.0
        r, last = self.cfg.rollout, self.cfg.trainer.max_steps
        t = time.perf_counter()
        buffers = flatten(sync_tensors(self.policy, self.lora), out=self._spare(step))
        # Lockstep: no batch is sampled with the weights after step max_steps - max_staleness or later,
        # but a longer resumed run samples its next batches with them (checkpoint_files); those due for
        # evaluation on the worker still go.
        beyond = step >= (last - r.max_staleness if r.lockstep else last)
        if beyond and step not in self.eval_steps:
            self._keep(step, buffers)
        else:
            self._send(step, buffers)
        stats.set_host(M.WEIGHT_SYNC_S, time.perf_counter() - t)

    def close(self) -> None:
        self.stop.set()
        self.process.join(STOP_GRACE_S)
        if self.process.is_alive():  # blocked in a weight sync the trainer will not send
            self.process.kill()
            self.process.join(STOP_GRACE_S)
        if self.channel is not None:
            self.channel.close()
        for q in (self.queue, self.evals):
            q.cancel_join_thread()
            q.close()


def build_rollouts(
    cfg: Config,
    *,
    sampler: PromptSampler,
    generation: GenerationEngine,
    tokenizer: PreTrainedTokenizerBase,
    rewards: RunScorer,
    rank: int,
    world_size: int,
    device: torch.device,
    policy: PreTrainedModel,
    lora: "LoraPolicy | None",
    examples: Sequence[Example],
    start_step: int,
    environment: "Environment | None" = None,
    in_flight: dict[str, torch.Tensor] | None = None,
    ranks_max: Callable[[torch.Tensor], torch.Tensor] = lambda x: x,
    scatter: Callable[[list | None], object] | None = None,
    eval_sets: HeldOutSets | None = None,
    eval_steps: Sequence[int] = (),
    eval_shared: Sequence[int] = (),
) -> RolloutSource:
    """The source `rollout.mode` names; build it after a resume restored the weights and the sampler.
    ranks_max: the MAX over the training ranks (`Engine.all_reduce_max`); scatter: `Engine.scatter_objects`
    (rollout=async on several ranks); eval_sets, eval_steps, eval_shared: what the worker evaluates
    (rollout.eval_on=worker|shared; AsyncRollouts)."""
    if cfg.rollout.mode == RolloutMode.SYNC:
        return SyncRollouts(
            cfg,
            sampler=sampler,
            generation=generation,
            tokenizer=tokenizer,
            rewards=rewards,
            rank=rank,
            world_size=world_size,
            device=device,
            environment=environment,
            ranks_max=ranks_max,
        )

    def worker(to: torch.device) -> AsyncRollouts:
        return AsyncRollouts(
            cfg,
            policy=policy,
            lora=lora,
            tokenizer=tokenizer,
            examples=examples,
            sampler=sampler,
            start_step=start_step,
            device=to,
            in_flight=in_flight,
            eval_sets=eval_sets,
            eval_steps=eval_steps,
            eval_shared=eval_shared,
        )

    if world_size == 1:
        return worker(device)
    assert scatter is not None
    # Rank 0 scatters the shares as pickled objects: on the CPU, each rank then moves its own share.
    return RankShares(
        worker(CPU) if rank == 0 else None,
        sampler=sampler,
        world_size=world_size,
        scatter=scatter,
        device=device,
    )


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
                state = self.sampler.state_dict()
                counted = [own.parts()] + [uncounted(own.parts())] * (self.world_size - 1)
                parts = split_sampled(whole, self.world_size)
                shares = [("ok", p, state, c) for p, c in zip(parts, counted, strict=True)]
            except RolloutWorkerError as err:
                shares = [("failed", str(err), err.detail)] * self.world_size
        kind, *rest = self.scatter(shares)
        if kind == "failed":
            raise RolloutWorkerError(rest[0], rest[1])
        part, state, counts = rest
        # Every rank logs the same keys in the same order (the step's metrics are one all-reduce of
        # them); only rank 0's values count.
        stats.merge(counts)
        self.sampler.load_state_dict(state)
        return tensors_to(part, self.device)

    def trained(self, step: int, stats: M.StepMetrics) -> None:
        if self.worker is not None:
            self.worker.trained(step, stats)

    def checkpoint_files(self, step: int) -> dict[str, dict[str, torch.Tensor]]:
        return {} if self.worker is None else self.worker.checkpoint_files(step)  # the main rank writes

    def borrowed_threads(self, step: int, chunk: int, chunks: int) -> int:
        return 0  # rank 0 alone sits beside the worker; every rank keeps its own threads

    def evaluations(self, steps: set[int], *, wait: bool) -> dict[int, dict[str, SetResult]]:
        return {} if self.worker is None else self.worker.evaluations(steps, wait=wait)  # rank 0 logs

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()


def uncounted(parts: tuple[dict, dict, dict, dict]) -> tuple[dict, dict, dict, dict]:
    """`StepMetrics.parts` with the same keys adding nothing: sums and counts 0, the same maxima."""
    sums, counts, maxes, host = parts
    zeros = {k: torch.zeros_like(v) for k, v in sums.items()}
    return zeros, {k: torch.zeros_like(v) for k, v in counts.items()}, dict(maxes), dict(host)


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
