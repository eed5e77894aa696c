"""rollout=async on GPUs through the real CLI (docs/rollouts.md, *Placement*): the generation worker on a GPU
of its own with the weights over NCCL, on the trainer's own GPU (gloo through the host), on the CPU beside
a GPU trainer, on a GPU beside a CPU trainer, beside two ZeRO-2 GPU ranks, and with its own vLLM engine.

The `gpu` tests skip, saying how many GPUs they need, where torch sees fewer; docs/gpu.md says which have
run on a GPU (the one-GPU ones, on an H200). CUDA is not bit-deterministic from run to run (atomic
adds in the embedding's backward), so two runs are compared by their rewards and completion lengths,
which depend only on the sampled tokens, exactly, and by their losses to 1e-4. The first test needs no
GPU: a rollout.device the machine cannot serve exits 2 naming the key, before anything loads."""

import math

import pytest
import torch

from grpo_run import checkpoint
from grpo_run import metrics as M
from tests.builders import LEARN, ZERO2
from tests.helpers import read_metrics, run_cli

ASYNC = ["rollout=async", "rollout.threads=1", "rollout.timeout_s=300"]
# The CPU suite's learning settings on the trainer's first GPU.
ON_GPU = [a for a in LEARN if a != "trainer.device=cpu"] + ["trainer.device=cuda"]


def needs_gpus(n: int):
    """Marked `gpu`, and skipped where torch sees fewer than n GPUs."""
    count = torch.cuda.device_count()
    skip = pytest.mark.skipif(count < n, reason=f"needs {n} NVIDIA GPU(s); torch sees {count}")
    return lambda test: pytest.mark.gpu(skip(test))


def output(proc) -> str:
    return proc.stdout + proc.stderr


def assert_same_run(a: list[dict], b: list[dict]) -> None:
    """The same steps, the same rewards and lengths (the same samples), losses to CUDA's rounding."""
    assert [r["step"] for r in a] == [r["step"] for r in b]
    assert [r[M.REWARD_MEAN] for r in a] == [r[M.REWARD_MEAN] for r in b]
    assert [r[M.COMPLETION_LEN_MEAN] for r in a] == [r[M.COMPLETION_LEN_MEAN] for r in b]
    for ra, rb in zip(a, b, strict=True):
        assert rb[M.LOSS] == pytest.approx(ra[M.LOSS], abs=1e-4), ra["step"]


def assert_trained(rows: list[dict], steps: list[int]) -> None:
    assert [r["step"] for r in rows] == steps
    assert all(math.isfinite(r[M.LOSS]) for r in rows)


@pytest.mark.parametrize(
    "device,env,message",
    [
        ("gpu0", {}, "rollout.device='gpu0': must be auto, cpu or cuda:N"),
        ("cuda:0", {"CUDA_VISIBLE_DEVICES": ""}, "rollout.device='cuda:0': torch sees 0 GPU(s)"),
    ],
)
def test_a_rollout_device_this_machine_cannot_serve_exits_2_naming_the_key(tmp_path, device, env, message):
    # CUDA_VISIBLE_DEVICES="" hides any GPU, so the second case holds on a GPU machine too.
    proc, run_dir = run_cli([*LEARN, *ASYNC, f"rollout.device={device}"], tmp_path, check=False, env=env)
    assert proc.returncode == 2, output(proc)
    assert message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert not (run_dir / "metrics.jsonl").exists()  # nothing ran


@needs_gpus(2)
def test_a_worker_on_its_own_gpu_over_nccl_equals_sync_at_staleness_0_and_runs_one_step_off(tmp_path):
    """Trainer on cuda:0, rollout.device=auto: the worker takes cuda:1 and the weights go over NCCL. At
    max_staleness=0 every batch is sampled by the weights being trained, from the same prompts and seeds,
    so the run is rollout=sync's on cuda:0; at 1 the steps after the first train one step off."""
    args = [*ON_GPU, "trainer.max_steps=3"]
    _, sync = run_cli(args, tmp_path / "sync", timeout=600)
    proc, zero = run_cli([*args, *ASYNC, "rollout.max_staleness=0"], tmp_path / "zero", timeout=600)
    assert "on cuda:1 (weights over nccl)" in output(proc), output(proc)
    rows = read_metrics(zero)
    assert_same_run(read_metrics(sync), rows)
    assert all(r[M.ASYNC_STALENESS_MAX] == 0 for r in rows)
    _, one = run_cli([*args, *ASYNC], tmp_path / "one", timeout=600)
    rows = read_metrics(one)
    assert_trained(rows, [1, 2, 3])
    assert [r[M.ASYNC_STALENESS_MAX] for r in rows] == [0, 1, 1]
    assert all(M.SAMPLER_RATIO_MEAN in r for r in rows[1:])


@needs_gpus(2)
def test_a_resume_over_nccl_starts_the_worker_from_the_checkpoints_weights(tmp_path):
    """max_staleness=1, resumed from the checkpoint of step 2: the resumed trainer sends the checkpoint's
    weights over NCCL, the batch in flight is sampled again by them (step 3 on-policy, step 4 one off)."""
    args = [*ON_GPU, *ASYNC, "rollout.device=cuda:1", "trainer.max_steps=4"]
    _, whole = run_cli([*args, "checkpoint.every_steps=2"], tmp_path / "whole")
    middle = whole / checkpoint.CHECKPOINTS / checkpoint.step_name(2)
    _, resumed = run_cli([*args, f"resume={middle}"], tmp_path / "resumed")
    rows = read_metrics(resumed)
    assert [r["step"] for r in rows] == [3, 4]
    assert [r[M.ASYNC_STALENESS_MAX] for r in rows] == [0, 1]


@needs_gpus(1)
def test_one_gpu_for_the_trainer_and_the_worker_syncs_through_the_host(tmp_path):
    """rollout.device=cuda:0 beside a trainer on cuda:0: two processes on one GPU cannot form an NCCL
    group, so the weights go over gloo through CPU buffers."""
    proc, run = run_cli([*ON_GPU, *ASYNC, "rollout.device=cuda:0", "trainer.max_steps=3"], tmp_path)
    assert "on cuda:0 (weights over gloo)" in output(proc), output(proc)
    rows = read_metrics(run)
    assert_trained(rows, [1, 2, 3])
    assert [r[M.ASYNC_STALENESS_MAX] for r in rows] == [0, 1, 1]


@needs_gpus(1)
def test_a_cpu_worker_beside_a_gpu_trainer(tmp_path):
    proc, run = run_cli([*ON_GPU, *ASYNC, "rollout.device=cpu", "trainer.max_steps=2"], tmp_path)
    assert "on cpu (weights over gloo)" in output(proc), output(proc)
    assert_trained(read_metrics(run), [1, 2])


@needs_gpus(1)
def test_a_gpu_worker_beside_a_cpu_trainer(tmp_path):
    proc, run = run_cli([*LEARN, *ASYNC, "rollout.device=cuda:0", "trainer.max_steps=2"], tmp_path)
    assert "on cuda:0 (weights over gloo)" in output(proc), output(proc)
    assert_trained(read_metrics(run), [1, 2])


@needs_gpus(3)
def test_two_zero2_gpu_ranks_and_the_worker_on_the_third_gpu(tmp_path):
    """distributed=zero2 on cuda:0 and cuda:1 (bf16 ZeRO-2 by default on a GPU that has it: the worker's
    copy takes the bf16 dtypes the trainer sends), the worker on cuda:2 (auto) over NCCL with rank 0;
    rank 0 scatters the shares on the CPU and each rank moves its own to its GPU."""
    args = [*ON_GPU, *ASYNC, *ZERO2, "trainer.max_steps=3", "trainer.micro_batch_size=2"]
    proc, run = run_cli(args, tmp_path, timeout=600)
    assert "on cuda:2 (weights over nccl)" in output(proc), output(proc)
    rows = read_metrics(run)
    assert_trained(rows, [1, 2, 3])
    assert [r[M.ASYNC_STALENESS_MAX] for r in rows] == [0, 1, 1]


@needs_gpus(2)
def test_the_workers_vllm_engine_on_its_own_gpu_takes_the_weights(tmp_path):
    """generation=vllm with the worker on cuda:1, a larger share of that GPU than the colocated default.
    At max_staleness=0 and lr 1e-2 every batch is sampled by the weights after the previous step; vLLM's
    log-probs agree with the trainer's only if each sync reached the engine."""
    from tests.integration.test_vllm import vllm_args, write_tiny32  # skips without vllm

    folder = tmp_path / "tiny32"
    write_tiny32(folder)
    head = [a for a in vllm_args(folder) if a != "trainer.device=cpu"]
    args = [*head, "trainer.device=cuda", *ASYNC, "rollout.device=cuda:1", "rollout.max_staleness=0"]
    args += ["generation.vllm.gpu_memory_utilization=0.6", "trainer.lr=1e-2", "trainer.max_steps=3"]
    proc, run = run_cli(args, tmp_path / "run", timeout=900)
    assert "on cuda:1 (weights over nccl)" in output(proc), output(proc)
    rows = read_metrics(run)
    assert_trained(rows, [1, 2, 3])
    assert all(r[M.SAMPLER_LOGPROB_DIFF_MAX] < 1e-2 for r in rows), rows
