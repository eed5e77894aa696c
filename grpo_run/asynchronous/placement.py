"""Where the generation worker of `rollout=async` runs (`rollout.device`), and what crosses between it and
the trainer when the two sit on different devices (docs/rollouts.md).

The trainer resolves `rollout.device` against its own device and the GPUs its process sees
(`worker_device`), then starts the worker with `CUDA_VISIBLE_DEVICES` naming that one GPU
(`worker_environment`): inside the worker torch, the generation engine and vLLM all use cuda:0. Batches
cross the process boundary on the CPU (`tensors_to`): a CUDA tensor sent through a queue would be
opened by the other process under its own numbering of the GPUs, which differs from the sender's.
"""

import contextlib
import copy
import dataclasses
import os
from collections.abc import Iterator, Mapping

import torch

from grpo_run.config import ConfigError
from grpo_run.config.schema import Config, DistributedKind
from grpo_run.config.validation import rollout_gpu_index

CPU = torch.device("cpu")
# The worker's only GPU, as it numbers it once CUDA_VISIBLE_DEVICES names that GPU alone.
WORKER_GPU = torch.device("cuda", 0)
VISIBLE = "CUDA_VISIBLE_DEVICES"


def training_gpus(cfg: Config) -> int:
    """How many GPUs of the node the training ranks use: local ranks 0 .. n-1 train on cuda:0 .. n-1."""
    d = cfg.distributed
    return d.nproc_per_node if d.kind == DistributedKind.DEEPSPEED else 1


def worker_device(
    rollout_device: str, trainer_device: torch.device, training_gpus: int, gpu_count: int
) -> torch.device:
    """The worker's device in the trainer's numbering of the GPUs: `rollout.device` resolved against the
    trainer's device, the GPUs the training ranks take and the GPUs torch sees (`gpu_count`)."""
    index = rollout_gpu_index(rollout_device)  # a ConfigError for a malformed value
    if index is not None:
        if index >= gpu_count:
            raise ConfigError(
                f"rollout.device={rollout_device!r}: torch sees {gpu_count} GPU(s) in the trainer's "
                f"process (cuda:0 .. cuda:{gpu_count - 1}); choose one of them, or rollout.device=cpu"
            )
        return torch.device("cuda", index)
    if rollout_device == "cpu" or trainer_device.type != "cuda":
        return CPU
    if gpu_count <= training_gpus:
        raise ConfigError(
            f"rollout.device='auto': the generation worker takes the first GPU no training rank uses, "
            f"cuda:{training_gpus}, but torch sees {gpu_count} GPU(s); ask for {training_gpus + 1} GPUs, or "
            f"set rollout.device=cuda:{trainer_device.index or 0} (the trainer's own GPU, slower weight "
            "syncs) or rollout.device=cpu"
        )
    return torch.device("cuda", training_gpus)


def visible_device(index: int, parent_visible: str | None) -> str:
    """What CUDA_VISIBLE_DEVICES must say for a child process to see exactly GPU `index` of a parent whose
    own CUDA_VISIBLE_DEVICES is `parent_visible` (None: unset, the parent sees every GPU)."""
    if parent_visible is None:
        return str(index)
    entries = [e.strip() for e in parent_visible.split(",") if e.strip()]
    if index >= len(entries):
        raise ConfigError(
            f"rollout.device='cuda:{index}': CUDA_VISIBLE_DEVICES={parent_visible!r} lists "
            f"{len(entries)} GPU(s)"
        )
    return entries[index]  # an index, a GPU-... UUID or a MIG-... id: passed on as the parent named it


def worker_environment(device: torch.device, parent_visible: str | None) -> dict[str, str]:
    """The variables the worker process starts with: its one GPU, or none for a CPU worker (so that
    nothing in it, vLLM included, opens a CUDA context on a training GPU)."""
    if device.type != "cuda":
        return {VISIBLE: ""}
    return {VISIBLE: visible_device(device.index or 0, parent_visible)}


def own_device(device: torch.device) -> torch.device:
    """The worker's device as the worker itself numbers it (it sees its GPU alone, as cuda:0)."""
    return WORKER_GPU if device.type == "cuda" else CPU


@contextlib.contextmanager
def spawn_environment(variables: Mapping[str, str]) -> Iterator[None]:
    """`variables` set in this process's environment while a child is spawned (a spawned process starts
    with a copy of it, before its first import), then put back as they were."""
    before = {k: os.environ.get(k) for k in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def tensors_to(tree, device: torch.device, memo: dict[int, object] | None = None):
    """`tree` (dataclasses, named tuples, lists, tuples and dicts of them) with every tensor on `device`.
    A part holding no tensor elsewhere is the same object, so on the tensors' own device nothing is copied;
    a part reached twice (a step's kept groups are its described groups) is moved once and stays shared."""
    memo = {} if memo is None else memo
    key = id(tree)
    if key not in memo:
        memo[key] = _moved(tree, device, memo)
    return memo[key]


def _moved(tree, device: torch.device, memo: dict[int, object]):
    if isinstance(tree, torch.Tensor):
        return tree.to(device)
    if isinstance(tree, dict):
        moved = {k: tensors_to(v, device, memo) for k, v in tree.items()}
        return tree if _unchanged(tree.values(), moved.values()) else moved
    if isinstance(tree, list | tuple):
        moved = [tensors_to(v, device, memo) for v in tree]
        if _unchanged(tree, moved):
            return tree
        return type(tree)(*moved) if hasattr(tree, "_fields") else type(tree)(moved)  # a NamedTuple: fields
    if dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        return _moved_dataclass(tree, device, memo)
    return tree


def _unchanged(old, new) -> bool:
    return all(a is b for a, b in zip(old, new, strict=True))


def _moved_dataclass(obj, device: torch.device, memo: dict[int, object]):
    """A shallow copy with the fields that hold tensors moved (no __init__ or __post_init__ runs again)."""
    names = [f.name for f in dataclasses.fields(obj)]
    moved = {n: tensors_to(getattr(obj, n), device, memo) for n in names}
    if all(moved[n] is getattr(obj, n) for n in names):
        return obj
    out = copy.copy(obj)
    for name, value in moved.items():
        object.__setattr__(out, name, value)  # frozen dataclasses too
    return out
