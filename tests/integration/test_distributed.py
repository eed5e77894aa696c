"""Data parallelism through the real `grpo-run` command: DeepSpeed ZeRO-2 on 2 CPU ranks over gloo.

The command starts its own ranks (one `python -m grpo_run.cli` each); a test-only `sitecustomize`
(rank_hooks/, put on PYTHONPATH) lets each rank write a digest of its parameters, or makes one rank raise.
"""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from grpo_run import metrics as M
from grpo_run.models.tiny import ensure_tiny_model
from tests.builders import ZERO2, hook_env, run_here, run_in, write_tiny_teacher
from tests.helpers import FAST, GRPO_RUN, REPO, adamw_tolerance, read_metrics, run_cli

# 2 prompts x 4 completions = 8 per step: 4 per rank, 2 micro-batches of 2 on each.
BASE = [a for a in FAST if not a.startswith(("trainer.max_steps", "trainer.micro_batch_size"))] + [
    "trainer.max_steps=3",
    "trainer.micro_batch_size=2",
    "trainer.lr=1e-3",  # large enough that 3 steps move the tiny model's weights visibly
    "logger=console",  # W&B has its own tests
    "logger.console=false",
]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_together(cwd: Path, commands: list[list[str]], envs: list[dict[str, str]] | None = None) -> None:
    """Start every `grpo-run` command at once in `cwd` and wait for all; each must succeed."""
    envs = envs or [dict(os.environ) for _ in commands]
    procs = [
        subprocess.Popen(
            [GRPO_RUN, *cmd], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for cmd, env in zip(commands, envs, strict=True)
    ]
    for proc in procs:
        out, err = proc.communicate(timeout=240)
        assert proc.returncode == 0, out + err


def the_one_run_dir(cwd: Path) -> Path:
    """The single run dir under cwd/outputs/runs, whose step-1 checkpoint holds both ranks' files."""
    run_dirs = [p for p in (cwd / "outputs" / "runs").glob("*/*") if p.is_dir()]
    assert len(run_dirs) == 1, run_dirs
    assert [r["step"] for r in read_metrics(run_dirs[0])] == [1]  # written once, by rank 0
    step = run_dirs[0] / "checkpoints" / "step_00000001"
    assert sorted(p.name for p in step.glob("rng_rank*.pt")) == ["rng_rank0.pt", "rng_rank1.pt"]
    return run_dirs[0]


def max_param_diff(a: Path, b: Path) -> float:
    wa, wb = load_file(a / "final" / "model.safetensors"), load_file(b / "final" / "model.safetensors")
    assert wa.keys() == wb.keys()
    return max((wa[k] - wb[k]).abs().max().item() for k in wa)


# The per_token case also recomputes every layer in the backward (the native forward's reentrant
# checkpoint under DeepSpeed's gradient hooks) and distils from a teacher (DISTILL). The third runs a policy-loss variant with the knobs that
# read more than a token's own values: the entropy quantile (over a micro-batch's loss tokens; each
# rank's micro-batches hold the same rows as the one process's) and the adaptive entropy bonus (steered
# by the step's entropy, reduced over the ranks), at mu = 2.
VARIANT = [
    "grpo.policy_loss=sapo",
    "grpo.num_iterations=2",
    "grpo.top_entropy_quantile=0.5",
    "grpo.entropy_control=adaptive",
    "grpo.entropy_target=100",
]


# On-policy distillation: each rank loads the teacher (another tiny model) and scores its own rows; the
# per-token advantages mix in the task reward's.
DISTILL = [
    "distill=teacher",
    "distill.teacher.path={teacher}",
    "distill.reward_weight=0.5",
    "distill.discount=0.5",
]


@pytest.mark.parametrize(
    ("aggregation", "checkpointing", "extra"),
    [
        ("per_response", "false", []),
        ("per_token", "true", DISTILL),
        ("per_token", "false", VARIANT),
    ],
    ids=["per_response", "per_token-checkpointing-distill", "sapo-entropy-knobs"],
)
def test_zero2_two_ranks_match_a_single_process_run(tmp_path, aggregation, checkpointing, extra, _cache_dir):
    teacher = write_tiny_teacher(tmp_path / "teacher", seed=1) if extra is DISTILL else None
    extra = [a.format(teacher=teacher) for a in extra]
    args = [*BASE, f"aggregation={aggregation}", f"model.gradient_checkpointing={checkpointing}", *extra]
    single_dir = run_here(args, tmp_path / "single" / "run")  # the baseline, in this process
    digests = tmp_path / "digests"
    digests.mkdir()
    proc = run_in(tmp_path / "zero2", [*args, *ZERO2], hook_env(GRPO_TEST_DIGEST_DIR=str(digests)))
    assert proc.returncode == 0, proc.stdout + proc.stderr

    # One run dir for both ranks: Hydra would otherwise give each rank its own timestamped one.
    run_dirs = [p for p in (tmp_path / "zero2" / "outputs" / "runs").glob("*/*") if p.is_dir()]
    assert len(run_dirs) == 1, run_dirs
    zero2_dir = run_dirs[0]
    # The command's own files (Hydra's, its log, the lock) beside what the one process wrote: nothing else.
    command = {".hydra", "cli.log", "run.lock"}
    assert {p.name for p in zero2_dir.iterdir()} == {p.name for p in single_dir.iterdir()} | command
    # Written once (by rank 0): exactly one line per step.
    assert (zero2_dir / "metrics.jsonl").read_text().count("\n") == 3
    zero2, single = read_metrics(zero2_dir), read_metrics(single_dir)
    assert [r["step"] for r in zero2] == [1, 2, 3]

    # Same samples: every reward and length statistic of every step agrees (sums differ only in order).
    for key in [M.REWARD_MEAN, M.REWARD_STD, M.COMPLETION_LEN_MEAN, M.COMPLETION_LEN_MAX, M.LOSS]:
        assert [r[key] for r in zero2] == pytest.approx([r[key] for r in single], rel=1e-5, abs=1e-7), key
    assert [r[M.GRAD_NORM] for r in zero2] == pytest.approx([r[M.GRAD_NORM] for r in single], rel=1e-4)
    # Each rank measures its own share of the weights' change: together, the one process's whole change.
    assert [r[M.UPDATE_NORM] for r in zero2] == pytest.approx([r[M.UPDATE_NORM] for r in single], rel=1e-3)
    for key in (M.SCORED_COMPLETIONS, M.TRAINED_COMPLETIONS):
        assert [r[key] for r in zero2] == [r[key] for r in single], key
    for key in (M.ENTROPY_KEPT_FRACTION, M.ENTROPY_COEF) if "grpo.policy_loss=sapo" in extra else ():
        assert [r[key] for r in zero2] == pytest.approx([r[key] for r in single], rel=1e-5, abs=1e-7), key

    if teacher is not None:  # each rank's share of the teacher's scores: together, the one process's
        kl = [r[M.DISTILL_TEACHER_KL] for r in single]
        assert [r[M.DISTILL_TEACHER_KL] for r in zero2] == pytest.approx(kl, rel=1e-5) and all(kl)

    # Every rank ends with the same parameters, and they are those of the one-process run.
    ranks = sorted(digests.glob("rank*.sha256"))
    assert [p.name for p in ranks] == ["rank0.sha256", "rank1.sha256"]
    assert ranks[0].read_text() == ranks[1].read_text()
    assert max_param_diff(zero2_dir, single_dir) < adamw_tolerance(lr=1e-3, steps=3)
    initial = load_file(ensure_tiny_model(_cache_dir) / "model.safetensors")
    trained = load_file(zero2_dir / "final" / "model.safetensors")
    assert sum(not torch.equal(initial[k], trained[k]) for k in initial) >= len(initial) // 2


def test_a_failing_rank_ends_the_job_with_its_error(tmp_path):
    """Rank 1 raises at step 2 while rank 0 waits in a collective: the launcher ends both, no hang."""
    stamp = tmp_path / "failed_at"
    env = hook_env(GRPO_TEST_FAIL_RANK="1", GRPO_TEST_FAIL_STEP="2", GRPO_TEST_FAIL_STAMP=str(stamp))
    proc = run_in(tmp_path, [*BASE, *ZERO2, f"hydra.run.dir={tmp_path / 'run'}"], env, timeout=180)
    ended = time.time()
    assert proc.returncode != 0
    assert "injected failure on rank 1 at step 2" in proc.stdout + proc.stderr
    # From the raise to the whole job's exit (start-up on a loaded 2-core machine is not counted).
    assert ended - float(stamp.read_text()) < 60
    # Step 1 finished on both ranks and was logged once; step 2 never completed.
    assert [json.loads(line)["step"] for line in (tmp_path / "run" / "metrics.jsonl").open()] == [1]


def test_ranks_an_outside_torchrun_started_share_rank_0s_run_dir(tmp_path):
    """`torchrun -m grpo_run.cli` without hydra.run.dir: each rank resolves its own timestamp, then
    all adopt rank 0's dir, so one checkpoint holds both ranks' optimizer shards; the other dir is gone.
    An empty model cache: both ranks build the tiny model at once, before they join."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    args = [*BASE, "distributed=zero2", "trainer.max_steps=1", "checkpoint.every_steps=1"]
    env = {**os.environ, "GRPO_RUN_CACHE": str(tmp_path / "cold-cache")}
    proc = subprocess.run(
        [*cmd, "-m", "grpo_run.cli", *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    step = the_one_run_dir(tmp_path) / "checkpoints" / "step_00000001"
    shards = sorted(p.name for p in (step / "deepspeed").glob("zero_pp_rank_*_optim_states.pt"))
    assert shards == [
        "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "zero_pp_rank_1_mp_rank_00_optim_states.pt",
    ]
    assert [p.name for p in (tmp_path / "cold-cache").iterdir()] == ["tiny-qwen2-v1"]


def test_ranks_with_srun_task_variables_join_as_ranks_in_one_run_dir(tmp_path):
    """What `srun --ntasks=2 grpo-run distributed=zero2` gives each task (no srun on this machine, so
    the two processes get its variables): each joins as SLURM_PROCID, and both write one run dir."""
    port = free_port()
    args = [*BASE, "distributed=zero2", "trainer.max_steps=1", f"distributed.master_port={port}"]
    slurm = {"SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NUM_NODES": "1", "SLURM_STEP_NODELIST": "localhost"}
    env = {**os.environ, **slurm, "SLURM_NODEID": "0"}
    envs = [{**env, "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r)} for r in (0, 1)]
    run_together(tmp_path, [args, args], envs)
    the_one_run_dir(tmp_path)


def test_two_nodes_without_a_pinned_run_dir_leave_one_run_dir(tmp_path):
    """Two node agents on this host (nnodes=2, one rank each): each claims a dir and starts its rank;
    the ranks train in node 0's, and node 1's agent removes its own, which holds only Hydra's record."""
    port = free_port()
    args = [*BASE, "distributed=zero2", "distributed.nnodes=2", "trainer.max_steps=1"]
    args += ["distributed.nproc_per_node=1", f"distributed.master_port={port}"]
    run_together(tmp_path, [[*args, f"distributed.node_rank={node}"] for node in (0, 1)])
    the_one_run_dir(tmp_path)


@pytest.mark.slow
def test_deepspeed_engine_checkpoint_flag_and_nonfinite_contract(tmp_path):
    """save_state/load_state resume exactly, broadcast_flag agrees, a NaN gradient skips the step."""
    script = Path(__file__).parent / "deepspeed_engine_contract.py"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    proc = subprocess.run(
        [*cmd, str(script), str(tmp_path / "ckpt")], capture_output=True, text=True, timeout=180, cwd=REPO
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("engine contract ok") == 2
    assert (tmp_path / "ckpt" / "deepspeed" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").exists()


@pytest.mark.parametrize(
    ("override", "key"),
    [
        (
            ["distributed=zero2", "distributed.nproc_per_node=3"],
            "trainer.prompts_per_step",
        ),  # 2 prompts, 3 ranks
        (
            ["distributed=zero2", "distributed.nproc_per_node=2", "trainer.micro_batch_size=8"],
            "trainer.micro_batch_size",
        ),
        (["distributed.nproc_per_node=2"], "distributed.kind"),  # the default distributed=single
    ],
)
def test_a_batch_that_does_not_split_over_the_ranks_fails_before_loading(tmp_path, override, key):
    proc, _ = run_cli([*BASE, *override], tmp_path, check=False, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert key in proc.stderr and "distributed.nproc_per_node" in proc.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_zero2_bf16_nccl_on_gpus(tmp_path):
    ranks = min(2, torch.cuda.device_count())
    args = [a for a in BASE if a != "trainer.device=cpu"] + [
        "trainer.device=cuda",
        "trainer.max_steps=2",
        "distributed=zero2",
        f"distributed.nproc_per_node={ranks}",
        "distributed.bf16=true",
    ]
    _, run_dir = run_cli(args, tmp_path, timeout=300)
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    assert all(torch.isfinite(torch.tensor(r[M.LOSS])) for r in rows)
    assert (run_dir / "final" / "model.safetensors").exists()


def test_dynamic_sampling_on_two_ranks_resamples_in_step_and_trains_equal_shares(tmp_path):
    """grpo.filter_zero_std on 2 ZeRO-2 ranks. Two-token completions, G = 2, reward = share of 'a':
    many groups score the same twice, so each rank's 2 prompts need a different number of rounds. The
    run goes through the real command and DeepSpeed's ranks (the agreement itself, rank by rank:
    tests/rollout/test_groups_ranks.py)."""
    args = [
        *BASE,
        "trainer.prompts_per_step=4",
        "grpo.group_size=2",
        "generation.max_new_tokens=2",
        "grpo.filter_zero_std=true",
        "grpo.max_resample_rounds=4",
        *ZERO2,
    ]
    proc = run_in(tmp_path, args, hook_env(), timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (run_dir,) = [p for p in (tmp_path / "outputs" / "runs").glob("*/*") if p.is_dir()]
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert sum(r[M.DROPPED_GROUPS] for r in rows) > 0
    assert max(r[M.GENERATION_ROUNDS] for r in rows) > 1  # some step resampled
    for row in rows:
        if M.LOSS in row:  # updated: only groups with a spread of rewards, on both ranks
            assert row[M.FRAC_REWARD_ZERO_STD] == 0.0
