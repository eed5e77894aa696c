"""How a rank joins the others: the process layout a launcher (grpo-run itself, torchrun, the deepspeed
launcher, srun) gave it, and the process group (gloo on CPU, NCCL on GPU).

`grpo_run/launcher.py` is the launcher `grpo-run` runs when it starts a node's ranks itself. The module
is light on import (the CLI reads it before validation): torch.distributed and deepspeed are imported
inside functions.
"""

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


@dataclass(frozen=True)
class Layout:
    """Where this process sits among the ranks."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1


def _slurm_tasks(env: Mapping[str, str]) -> tuple[int, int]:
    """(tasks, nodes) of the current srun step; (1, 1) outside one."""
    tasks = int(env.get("SLURM_STEP_NUM_TASKS", "1"))
    nodes = int(env.get("SLURM_STEP_NUM_NODES", env.get("SLURM_NNODES", "1")))
    return tasks, max(nodes, 1)


def first_slurm_host(nodelist: str) -> str:
    """The first host of a Slurm node list: 'gpu[03-05,9],cpu1' -> 'gpu03'."""
    m = re.match(r"([^,\[]+)(?:\[([^\]\-,]+))?", nodelist.strip())
    if m is None:
        raise ValueError(f"cannot read a host from the Slurm node list {nodelist!r}")
    return m.group(1) + (m.group(2) or "")


def slurm_node_agent(nproc_per_node: int, env: Mapping[str, str] = os.environ) -> bool:
    """srun started one task per node and each should start nproc_per_node ranks itself."""
    tasks, nodes = _slurm_tasks(env)
    return "SLURM_PROCID" in env and tasks == nodes and nproc_per_node > 1


def started_by_launcher(env: Mapping[str, str] = os.environ, nproc_per_node: int = 1) -> Layout | None:
    """The layout when torchrun / deepspeed / srun already started this process as one rank; else None."""
    if all(k in env for k in TORCHRUN_VARS):
        world = int(env["WORLD_SIZE"])
        return Layout(
            int(env["RANK"]), world, int(env["LOCAL_RANK"]), int(env.get("LOCAL_WORLD_SIZE", world))
        )
    tasks, nodes = _slurm_tasks(env)
    if "SLURM_PROCID" in env and tasks > 1 and not slurm_node_agent(nproc_per_node, env):
        return Layout(int(env["SLURM_PROCID"]), tasks, int(env.get("SLURM_LOCALID", "0")), tasks // nodes)
    return None


def adopt_launcher(dist: Any, env: Mapping[str, str] = os.environ) -> None:
    """Make the `distributed` config node describe the ranks a launcher or Slurm already decided.

    `dist` is the composed (not yet typed) `distributed` node, so validation then checks the real
    world size. Under srun with one task per node, the node's place comes from Slurm instead.
    """
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
    if nodelist and "SLURM_PROCID" in env and dist.master_addr == "127.0.0.1":
        dist.master_addr = first_slurm_host(nodelist)
    if slurm_node_agent(int(dist.nproc_per_node), env):
        dist.nnodes = _slurm_tasks(env)[1]
        dist.node_rank = int(env.get("SLURM_NODEID", "0"))
        return
    layout = started_by_launcher(env, int(dist.nproc_per_node))
    if layout is not None:
        dist.nproc_per_node = layout.local_world_size
        dist.nnodes = layout.world_size // layout.local_world_size


def world_size(dist: Any) -> int:
    return int(dist.nproc_per_node) * int(dist.nnodes)


def needs_self_launch(dist: Any, env: Mapping[str, str] = os.environ) -> bool:
    return world_size(dist) > 1 and started_by_launcher(env, int(dist.nproc_per_node)) is None


def is_main_process(env: Mapping[str, str] = os.environ) -> bool:
    """Rank 0 (or no launcher at all): the only process that writes the run dir."""
    layout = started_by_launcher(env)
    return layout is None or layout.rank == 0


def init_process_group(device_type: str, master_addr: str, master_port: int, timeout_s: float) -> Layout:
    """Join the ranks (gloo on CPU, NCCL on GPU) through deepspeed.comm; a lone process makes a world of 1.

    `timeout_s` bounds every collective: gloo raises in the waiting rank, NCCL's watchdog aborts it.
    """
    import datetime

    import deepspeed

    layout = started_by_launcher(os.environ) or Layout()
    # srun or a bare process: give torch's env:// rendezvous what torchrun would have set.
    os.environ.setdefault("RANK", str(layout.rank))
    os.environ.setdefault("WORLD_SIZE", str(layout.world_size))
    os.environ.setdefault("LOCAL_RANK", str(layout.local_rank))
    os.environ.setdefault("MASTER_ADDR", master_addr)
    os.environ.setdefault("MASTER_PORT", str(free_port() if layout.world_size == 1 else master_port))
    if device_type == "cpu":
        # DeepSpeed's CPU backend JIT-compiles a shared-memory all-reduce (~50 s, needs g++) that only
        # serves its inference all-reduce; ZeRO's gradient reduction goes through gloo. Mark it
        # unavailable so every CPU run starts at once (deepspeed.ops documents this dict as editable).
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    else:
        import torch

        torch.cuda.set_device(layout.local_rank)
    timeout = datetime.timedelta(seconds=timeout_s)
    deepspeed.init_distributed(
        dist_backend="gloo" if device_type == "cpu" else "nccl", verbose=False, timeout=timeout
    )
    groups_time_out(timeout)
    return layout


def groups_time_out(timeout) -> None:
    """Every process group made after this carries `timeout`, not torch's default (30 min for gloo, 10
    for NCCL): DeepSpeed makes its own groups with `new_group(ranks)` and no timeout (ZeRO's gradient
    reduction runs on its clone of the world group, `deepspeed.utils.groups._clone_world_group`), so a
    rank stalled there would hold the others for half an hour. torch reads these module defaults for
    every group created without a timeout (`distributed_c10d._get_default_timeout`)."""
    import torch.distributed.distributed_c10d as c10d

    c10d.default_pg_timeout = timeout
    if hasattr(c10d, "default_pg_nccl_timeout"):
        c10d.default_pg_nccl_timeout = timeout


def rank0_run_dir(run_dir: str) -> str:
    """Rank 0's run dir, on every rank of the joined process group.

    Ranks that torchrun or srun started each resolved `hydra.run.dir` on their own, so without a
    pinned `hydra.run.dir` their timestamps differ: checkpoints would be split over several dirs.
    """
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return run_dir
    box = [run_dir]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def shutdown() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
