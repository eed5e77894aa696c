"""The weight path from the trainer to a generation worker: a two-process gloo group of torch.distributed
(rank 0 the trainer, rank 1 the worker), separate from any group the training ranks use.

Each sync is one broadcast of a header (the policy version) and one of the weights flattened per dtype, in
the order of the model's `named_parameters` (tied weights once), which both sides build from the same
architecture. The trainer's broadcast is asynchronous: it copies the weights into its own buffer, so the
next update can change the parameters while the worker is still generating, and waits for the previous
sync to finish before it starts the next one (at most one in flight).
"""

import datetime
from collections.abc import Sequence

import torch
import torch.distributed as dist

TRAINER, WORKER = 0, 1
VERSION_KEY = "weights_version"  # the newest version the trainer has started to send


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
    sends, and what `receive` splits back into a model's parameters."""
    return [torch.cat([t.detach().reshape(-1) for t in ts]) for ts in _flat_by_dtype(tensors).values()]


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
    ) -> None:
        """The worker joins the trainer's store on `port` and first sets `ready_key` in it, so the trainer
        can tell a worker that is about to join from one that died on the way (`joined`)."""
        timeout = datetime.timedelta(seconds=timeout_s)
        if store is None:
            store = dist.TCPStore(
                "127.0.0.1", port, world_size=2, is_master=False, timeout=timeout, wait_for_workers=False
            )
        if ready_key is not None:
            store.set(ready_key, "1")
        self.rank = rank
        self._store = store
        self._group = dist.ProcessGroupGloo(store, rank, 2, timeout)
        self._in_flight: list | None = None  # (works, buffers) of the trainer's last sync

    def send(self, version: int, buffers: Sequence[torch.Tensor]) -> None:
        """Trainer: start broadcasting `buffers` (`flatten` of the weights, which must not change until the
        next send) as `version`; returns once the previous sync is done."""
        self.wait()
        header = torch.tensor([version], dtype=torch.long)  # [1]
        buffers = [header, *buffers]
        self._in_flight = [self._group.broadcast(b, TRAINER) for b in buffers] + [buffers]
        self._store.set(VERSION_KEY, str(version))

    def latest(self) -> int:
        """Worker: the newest version the trainer has started to send (the sync to `receive` next is older
        or equal)."""
        return int(self._store.get(VERSION_KEY))

    def wait(self) -> None:
        """Trainer: the last sync has reached the worker."""
        if self._in_flight is not None:
            for work in self._in_flight[:-1]:
                work.wait()
            self._in_flight = None

    @torch.no_grad()
    def receive(self, tensors: Sequence[torch.Tensor]) -> int:
        """Worker: the next sync's weights copied into `tensors` (in place); returns its version."""
        header = torch.zeros(1, dtype=torch.long)
        self._group.broadcast(header, TRAINER).wait()
        for dtype, ts in _flat_by_dtype(tensors).items():
            flat = torch.empty(sum(t.numel() for t in ts), dtype=dtype)
            self._group.broadcast(flat, TRAINER).wait()
            offset = 0
            for t in ts:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()
        return int(header.item())

    def close(self) -> None:
        self._in_flight = None
        self._group = None  # gloo's connections close with the group
