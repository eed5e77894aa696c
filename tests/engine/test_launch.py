"""Launcher detection, Slurm layouts, the torchrun command line and the DeepSpeed JSON (no processes)."""

from types import SimpleNamespace

import pytest

from grpo_run.engine.deepspeed_engine import deepspeed_config
from grpo_run.engine.launch import (
    Layout,
    adopt_launcher,
    first_slurm_host,
    needs_self_launch,
    started_by_launcher,
    torchrun_command,
)


def dist(**kw):
    base = dict(nproc_per_node=1, nnodes=1, node_rank=0, master_addr="127.0.0.1", master_port=29500)
    return SimpleNamespace(**{**base, **kw})


@pytest.mark.parametrize(
    ("nodelist", "host"),
    [("gpu07", "gpu07"), ("gpu[03-05,9]", "gpu03"), ("a[1,4],b2", "a1"), ("n1,n2", "n1")],
)
def test_first_slurm_host(nodelist, host):
    assert first_slurm_host(nodelist) == host


def test_torchrun_env_is_a_launcher():
    env = {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    assert started_by_launcher(env) == Layout(rank=3, world_size=8, local_rank=1, local_world_size=2)
    d = dist(nproc_per_node=1)
    adopt_launcher(d, env)
    assert (d.nproc_per_node, d.nnodes) == (2, 4)
    assert not needs_self_launch(d, env)


def test_srun_with_one_task_per_rank():
    env = {"SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_STEP_NUM_TASKS": "8"}
    env |= {"SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_NODELIST": "node[12-13]"}
    assert started_by_launcher(env) == Layout(rank=5, world_size=8, local_rank=1, local_world_size=4)
    d = dist()
    adopt_launcher(d, env)
    assert (d.nproc_per_node, d.nnodes, d.master_addr) == (4, 2, "node12")


def test_srun_with_one_task_per_node_launches_the_node_ranks():
    env = {"SLURM_PROCID": "1", "SLURM_NODEID": "1", "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NUM_NODES": "2"}
    env["SLURM_STEP_NODELIST"] = "gpu[01-02]"
    d = dist(nproc_per_node=8)
    adopt_launcher(d, env)
    assert (d.nnodes, d.node_rank, d.master_addr) == (2, 1, "gpu01")
    assert needs_self_launch(d, env)
    cmd = torchrun_command(d, ["model=tiny"], "/runs/x", "config")
    assert "--nnodes=2" in cmd and "--node-rank=1" in cmd and "--master-addr=gpu01" in cmd


def test_a_plain_process_or_batch_script_is_not_a_launcher():
    assert started_by_launcher({}) is None
    assert started_by_launcher({"SLURM_PROCID": "0", "SLURM_NTASKS": "8"}) is None  # sbatch, no srun
    assert not needs_self_launch(dist(), {})
    assert needs_self_launch(dist(nproc_per_node=2), {})


def test_single_node_command_pins_the_run_dir_and_keeps_the_overrides():
    cmd = torchrun_command(dist(nproc_per_node=2), ["model=tiny", "trainer.lr=0.1"], "/runs/x", "config")
    assert "--standalone" in cmd and "--nproc-per-node=2" in cmd
    assert cmd[cmd.index("grpo_run.cli") + 1 :] == [
        "model=tiny",
        "trainer.lr=0.1",
        "hydra.run.dir=/runs/x",
        "hydra.output_subdir=null",
        "hydra/job_logging=stdout",
    ]


def test_deepspeed_config_takes_batch_and_clipping_from_the_trainer():
    cfg = deepspeed_config(
        zero_stage=2,
        offload_optimizer=True,
        bf16=False,
        micro_batch_size=4,
        completions_per_step=64,
        world_size=4,
        max_grad_norm=0.5,
    )
    # 64 completions / 4 ranks = 16 per rank = 4 micro-batches of 4.
    assert (cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"]) == (4, 4)
    assert cfg["train_batch_size"] == 64 and cfg["gradient_clipping"] == 0.5
    # The loss is already the step's: sum over ranks, no division by the accumulation steps.
    assert cfg["gradient_allreduce_op"] == "sum" and cfg["managed_gradient_accumulation"] is False
    assert cfg["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
