"""The weight path from the trainer to a generation worker: a two-process group of torch.distributed
(rank 0 the trainer, rank 1 the worker), separate from any group the training ranks use.

Each sync is one broadcast of a header (the policy version) and one of the weights flattened per dtype, in
the order of the model's `named_parameters` (tied weights once), which both sides build from the same
architecture. The trainer's broadcast is asynchronous: it copies the weights into its own buffer, so the
next update can change the parameters while the worker is still generating, and waits for the previous
sync to finish before it starts the next one (at most one in flight). The worker's parameters are views
of its flat buffers (`pack`), which the broadcast writes into directly.

The backend follows where the two sides are (`channel_backend`): NCCL between two different GPUs, with
the buffers on each side's GPU; gloo with CPU buffers otherwise. Under gloo a GPU side copies through the
host: the trainer sends CPU copies of its flat buffers, a GPU worker receives into CPU buffers and copies
them into its parameters. Two processes on one GPU cannot form an NCCL group (NCCL refuses two ranks on
one device), so that placement takes gloo as well.
"""

import datetime
from collections.abc import Sequence

import torch
import torch.distributed as dist

TRAINER, WORKER = 0, 1
VERSION_KEY = "weights_version"  # the newest version the trainer has started to send
GLOO, NCCL = "gloo", "nccl"
CPU = torch.device("cpu")


def channel_backend(trainer: torch.device, worker: torch.device) -> str:
    """NCCL when the trainer and the worker sit on two different GPUs (indices as the trainer numbers
    them), gloo through CPU buffers otherwise: a side on the CPU, or both on one GPU."""
    both_cuda = trainer.type == "cuda" and worker.type == "cuda"
    return NCCL if both_cuda and (trainer.index or 0) != (worker.index or 0) else GLOO


def _process_group(backend: str, store: dist.Store, rank: int, timeout: datetime.timedelta):
    if backend == GLOO:
        return dist.ProcessGroupGloo(store, rank, 2, timeout)
    if not dist.is_nccl_available():
        raise RuntimeError(
            f"the weight channel needs NCCL between two GPUs, and torch {torch.__version__} has none "
            "(a CPU-only build?): install a CUDA build of torch, or set rollout.device=cpu"
        )
    return dist.ProcessGroupNCCL(store, rank, 2, timeout)


def open_store(timeout_s: float) -> tuple[dist.TCPStore, int]:
    """The trainer's rendezvous store on a free local port: (store, port) for the worker to join."""
    store = dist.TCPStore(
        "127.0.0.1",
        0,
        world_size=2,
        is_master=True,
        timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )
    return store, store.port


def joined(store: dist.TCPStore, key: str) -> bool:
    """Trainer: the worker has set `key` in the store (it is joining the weight group)."""
    return store.check([key])


def _flat_by_dtype(tensors: Sequence[torch.Tensor]) -> dict[torch.dtype, list[torch.Tensor]]:
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.dtype, []).append(t)
    return groups


def flatten(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """A copy of `tensors` as one flat buffer per dtype (in order of first appearance): what one sync
    sends, and what `pack` lays a model's parameters over."""
    return [torch.cat([t.detach().reshape(-1) for t in ts]) for ts in _flat_by_dtype(tensors).values()]


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


def pack(params: Sequence[torch.nn.Parameter]) -> list[torch.Tensor]:
    """Lay `params` over one flat buffer per dtype (`flatten`'s layout, values unchanged), each parameter
    becoming a view of its buffer: `WeightChannel.receive` then writes a sync straight into the
    parameters, with no buffer of the model's size allocated and copied per sync."""
    flats = flatten(params)
    with torch.no_grad():
        for flat, ps in zip(flats, _flat_by_dtype(params).values()):
            offset = 0
            for p in ps:
                p.data = flat[offset : offset + p.numel()].view_as(p)
                offset += p.numel()
    return flats


class WeightChannel:
    """One side of the trainer → worker weight sync."""

    def __init__(
        self,
        rank: int,
        *,
        port: int,
        timeout_s: float,
        store: dist.TCPStore | None = None,
        ready_key: str | None = None,
        backend: str = GLOO,
        device: torch.device = CPU,
    ) -> None:
        """The worker joins the trainer's store on `port` and first sets `ready_key` in it, so the trainer
        can tell a worker that is about to join from one that died on the way (`joined`). `backend`: both
        sides' `channel_backend`; `device`: this side's device (NCCL's buffers live there)."""
        timeout = datetime.timedelta(seconds=timeout_s)
        if store is None:
            store = dist.TCPStore(
                "127.0.0.1", port, world_size=2, is_master=False, timeout=timeout, wait_for_workers=False
            )
        if ready_key is not None:
            store.set(ready_key, "1")
        self.rank, self.backend = rank, backend
        # Where the broadcast buffers live: this side's GPU under NCCL, the host under gloo.
        self.device = device if backend == NCCL else CPU
        self._store = store
        self._group = _process_group(backend, store, rank, timeout)
        self._in_flight: list | None = None  # (works, buffers) of the trainer's last sync
        self._staging: dict[int, torch.Tensor] = {}  # worker: host landing buffers for a GPU under gloo

    def send(self, version: int, buffers: Sequence[torch.Tensor]) -> None:
        """Trainer: start broadcasting `buffers` (`flatten` of the weights, which must not change until the
        next send) as `version`; returns once the previous sync is done. Buffers elsewhere than
        `self.device` are copied there first."""
        self.wait()
        header = torch.tensor([version], dtype=torch.long, device=self.device)  # [1]
        buffers = [header, *(b.to(self.device) for b in buffers)]
        self._in_flight = [self._group.broadcast(b, TRAINER) for b in buffers] + [buffers]
        self._store.set(VERSION_KEY, str(version))

    def sent_after(self, version: int) -> bool:
        """Worker: whether the trainer has started to send a version newer than `version`; never blocks
        (so a worker waiting for weights through a long trainer evaluation is not a timed-out receive)."""
        return self._store.check([VERSION_KEY]) and int(self._store.get(VERSION_KEY)) > version

    def latest(self) -> int:
        """Worker: the newest version the trainer has started to send (the sync to `receive` next is older
        or equal)."""
        return int(self._store.get(VERSION_KEY))

    def done(self) -> bool:
        """Trainer: the last sync has reached the worker (or none was sent); never blocks."""
        return self._in_flight is None or all(work.is_completed() for work in self._in_flight[:-1])

    def wait(self) -> None:
        """Trainer: the last sync has reached the worker."""
        if self._in_flight is not None:
            for work in self._in_flight[:-1]:
                work.wait()
            self._in_flight = None

    @torch.no_grad()
    def receive(self, flats: Sequence[torch.Tensor]) -> int:
        """Worker: the next sync's weights written into `flats` (`pack` of the model's parameters, in
        place, on their own device); returns its version. A GPU worker under gloo receives into host
        buffers it keeps from sync to sync, then copies them to the GPU."""
        header = torch.zeros(1, dtype=torch.long, device=self.device)
        self._group.broadcast(header, TRAINER).wait()
        for i, flat in enumerate(flats):
            landing = flat
            if flat.device != self.device:
                if i not in self._staging:
                    self._staging[i] = torch.empty(flat.shape, dtype=flat.dtype, device=self.device)
                landing = self._staging[i]
            self._group.broadcast(landing, TRAINER).wait()
            if landing is not flat:
                flat.copy_(landing)
        return int(header.item())

    def close(self) -> None:
        self._in_flight = None
        if self.backend == NCCL and self._group is not None:
            # A sync the worker never took would keep its kernel waiting on the GPU; abort ends it.
            self._group.abort()
        self._group = None  # gloo's connections close with the group
