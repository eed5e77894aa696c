"""rollout=async: a generation worker process, the gloo weight sync, the staleness bound, stop and resume,
a dying worker (docs/rollouts.md). Signals, deaths and the bit-for-bit comparison with the synchronous
loop go through the real command; the other runs train in this process (`run_here`: the same code from
the composed config on, its worker spawned as the command spawns it), which saves a process start each."""

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import grpo_run.trainer as trainer
from grpo_run import checkpoint
from grpo_run import metrics as M
from grpo_run.evaluation.stats import read_problems
from grpo_run.safety.signals import EXIT_PREEMPTED
from tests.builders import LEARN, QUIET, config, run_here
from tests.helpers import FAST, GRPO_RUN, REPO, read_metrics, run_cli

ASYNC = ["rollout=async", "rollout.threads=1", "rollout.timeout_s=120"]


def in_process(args: list[str], run_dir: Path) -> Path:
    """A synchronous baseline, trained in this process."""
    trainer.train(config(args, run_dir))
    return run_dir


def comparable(row: dict) -> dict:
    """A metrics row without timings, memory and the async bookkeeping."""
    return {k: v for k, v in row.items() if not k.startswith(("perf/", "async/"))}


def test_staleness_zero_is_the_synchronous_loop_bit_for_bit(tmp_path):
    """max_staleness=0: the worker waits for every update, so each batch is sampled by the weights being
    trained, from the same prompts and seeds: every metric and the final weights equal rollout=sync's."""
    args = [*LEARN, "trainer.max_steps=3"]
    sync = in_process(args, tmp_path / "sync")
    proc, run = run_cli([*args, *ASYNC, "rollout.max_staleness=0"], tmp_path / "async")
    assert "generation worker pid" in proc.stderr + proc.stdout
    a, b = read_metrics(sync), read_metrics(run)
    assert [comparable(r) for r in a] == [comparable(r) for r in b]
    assert all(r[M.ASYNC_STALENESS_MAX] == 0 and r[M.ASYNC_DROPPED_STALE] == 0 for r in b)
    assert not any(k.startswith("async/") for r in a for k in r)  # logged under async only
    wa = load_file(sync / "final" / "model.safetensors")
    wb = load_file(run / "final" / "model.safetensors")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_multi_turn_episodes_from_the_worker_equal_the_synchronous_loops(tmp_path):
    """An environment that answers every turn (tests/envs/toy.py), 3 turns: the worker plays the episodes
    (observation tokens masked out of the loss by Rollout.trainable_mask); at max_staleness=0 every metric
    equals rollout=sync's, and one step off the run trains on them with the behaviour weight."""
    env = ["env.name=always", "+env._target_=tests.envs.toy.AlwaysAnswers", "env.max_turns=3"]
    args = [*LEARN, *env, "env.max_total_tokens=40", "trainer.max_steps=2"]
    sync = in_process(args, tmp_path / "sync")
    zero = run_here([*args, *ASYNC, "rollout.max_staleness=0"], tmp_path / "zero")
    a, b = read_metrics(sync), read_metrics(zero)
    assert all(r[M.ENV_OBSERVATION_TOKENS_MEAN] > 0 for r in a)
    assert [comparable(r) for r in a] == [comparable(r) for r in b]
    one = run_here([*args, *ASYNC], tmp_path / "one")
    rows = read_metrics(one)
    assert [r[M.ASYNC_STALENESS_MAX] for r in rows] == [0, 1] and M.SAMPLER_RATIO_MEAN in rows[1]


# A tool called on every turn (tests/envs/toy.py: RecordsCalls), a cost per call and half of each group
# tool-free: the cost is exactly call_cost x calls per episode (additive, every episode scorable).
COST_AND_SHARE = [
    "env.name=records",
    "+env._target_=tests.envs.toy.RecordsCalls",
    "env.max_turns=3",
    "env.max_total_tokens=40",
    "env.call_cost=0.1",
    "env.cost_form=additive",
    "env.reward_levels=[0,1]",
    "env.tool_free_share=0.5",
]


def test_the_cost_and_the_tool_free_share_from_the_worker_equal_the_synchronous_loops(tmp_path):
    """env.call_cost and env.tool_free_share act where both loops score their groups: at max_staleness=0
    the worker's rewards and every metric equal rollout=sync's."""
    args = [*LEARN, *COST_AND_SHARE, "trainer.max_steps=2"]
    sync = in_process(args, tmp_path / "sync")
    zero = run_here([*args, *ASYNC, "rollout.max_staleness=0"], tmp_path / "zero")
    a, b = read_metrics(sync), read_metrics(zero)
    assert [comparable(r) for r in a] == [comparable(r) for r in b]
    for r in a:
        assert (
            r[M.ENV_CALL_COST_MEAN] == pytest.approx(0.1 * r[M.ENV_TOOL_CALLS_MEAN])
            and r[M.ENV_CALL_COST_MEAN] > 0
        )
        assert M.TOOL_FREE_REWARD_MEAN in r and M.TOOL_REWARD_MEAN in r
        # half the episodes of each group: the step's mean reward is the mean of the two halves'
        halves = (r[M.TOOL_FREE_REWARD_MEAN] + r[M.TOOL_REWARD_MEAN]) / 2
        assert r[M.REWARD_MEAN] == pytest.approx(halves)


def test_one_step_off_trains_on_the_previous_weights_and_is_reproducible(tmp_path):
    """max_staleness=1 in lockstep: step 1 from the start weights (staleness 0), every later step from the
    weights one step older than the trained ones, corrected by pi_prox / pi_behaviour (train/sampler_*);
    two runs give the same metrics and evaluations. The trainer evaluates steps 0, 2 and 4 between steps,
    with its own engine, while the worker samples on; KnockTool's greedy tool-call rate moves with the
    weights, so an evaluation of other weights than the step's would show."""
    knock = ["env.name=knock", "+env._target_=tests.envs.toy.KnockTool", "+env.kwargs.knock=a"]
    evals = ["eval.every_steps=2", "eval.num_prompts=8", "eval.samples_per_prompt=2", "eval.batch_size=4"]
    args = [*LEARN, *ASYNC, *knock, *evals, "env.max_turns=2", "trainer.lr=1e-2", "trainer.warmup_steps=0"]
    args += ["grpo.beta=0.0", "trainer.prompts_per_step=4", "trainer.max_steps=4"]
    # Weights that move the greedy tool-call rate within 4 steps at this seed (under the per-token
    # correction async sets by default it stays at 0 here, which would not show a wrong version).
    args += ["grpo.rollout_correction=sequence_mask"]
    runs = [run_here(args, tmp_path / name) for name in ("first", "again")]
    a, b = read_metrics(runs[0]), read_metrics(runs[1])
    assert [r["step"] for r in a] == [0, 1, 2, 3, 4]
    assert [r[M.ASYNC_STALENESS_MAX] for r in a[1:]] == [0, 1, 1, 1]
    assert M.SAMPLER_RATIO_MEAN not in a[1] and all(M.SAMPLER_RATIO_MEAN in r for r in a[2:])
    rates = [r[M.EVAL_TOOL_CALL_RATE] for r in a if M.EVAL_TOOL_CALL_RATE in r]
    assert len(rates) == 3 and len(set(rates)) > 1, rates
    assert [comparable(r) for r in a] == [comparable(r) for r in b]
    for step in (0, 2, 4):
        assert read_problems(runs[0], step) == read_problems(runs[1], step), step


def test_the_decoders_behaviour_logprobs_train_as_the_recomputed_ones(tmp_path):
    """One step off, π_behaviour from the decoder while it samples (the default) against the training
    forward recomputing it in the worker (rollout.recompute_behaviour_logprobs=true): in float32 the two
    differ by rounding only, so the runs sample the same tokens and train alike."""
    args = [*LEARN, *ASYNC, "trainer.max_steps=3"]
    decoder = run_here(args, tmp_path / "decoder")
    forward = run_here([*args, "rollout.recompute_behaviour_logprobs=true"], tmp_path / "forward")
    a, b = read_metrics(decoder), read_metrics(forward)
    assert [r[M.ASYNC_STALENESS_MAX] for r in a] == [0, 1, 1]
    assert all(M.SAMPLER_RATIO_MEAN in r for r in a[1:] + b[1:])
    for ra, rb in zip(a, b, strict=True):
        assert (
            ra[M.REWARD_MEAN] == rb[M.REWARD_MEAN] and ra[M.COMPLETION_LEN_MEAN] == rb[M.COMPLETION_LEN_MEAN]
        )
        for key in (M.LOSS, M.SAMPLER_RATIO_MEAN):
            if key in ra:
                assert ra[key] == pytest.approx(rb[key], abs=1e-5), (ra["step"], key)


def test_a_resume_samples_the_batches_in_flight_again_from_the_checkpoints_weights(tmp_path):
    """max_staleness=1 in lockstep, resumed from the checkpoint of step 2 (as verl and TRL resume): the
    batch the interrupted run had in flight (3, from the weights after step 1) is sampled again by the
    checkpoint's own weights, so step 3 is on-policy and step 4 one step off; the prompts and seeds are
    the interrupted run's, so the resumed run is as reproducible as a fresh one. Nothing beyond the
    ordinary checkpoint is saved for it."""
    args = [*LEARN, *ASYNC, "trainer.max_steps=4"]
    whole = run_here([*args, "checkpoint.every_steps=2"], tmp_path / "whole")
    middle = whole / checkpoint.CHECKPOINTS / checkpoint.step_name(2)
    assert sorted(p.name for p in middle.iterdir()) == sorted(
        p.name for p in (whole / checkpoint.CHECKPOINTS / checkpoint.step_name(4)).iterdir()
    )
    resumed = run_here([*args, f"resume={middle}"], tmp_path / "resumed")
    a, b = read_metrics(whole), read_metrics(resumed)
    assert [r["step"] for r in b] == [3, 4]
    assert [r[M.ASYNC_STALENESS_MAX] for r in a] == [0, 1, 1, 1]
    assert [r[M.ASYNC_STALENESS_MAX] for r in b] == [0, 1]
    assert M.SAMPLER_RATIO_MEAN not in b[0] and M.SAMPLER_RATIO_MEAN in b[1]  # on-policy, then corrected


def test_free_running_drops_batches_older_than_max_staleness_and_counts_them(tmp_path):
    """lockstep=false with max_staleness=0: the worker samples batch 2 with the start weights while step 1
    trains (it has nothing newer), so step 2 finds it one step old, drops it and counts it."""
    args = [*FAST, *QUIET, *ASYNC, "rollout.lockstep=false", "rollout.max_staleness=0", "trainer.max_steps=3"]
    _, run = run_cli(args, tmp_path)
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r[M.ASYNC_STALENESS_MAX] == 0 for r in rows)  # nothing older than k was trained on
    assert rows[1][M.ASYNC_DROPPED_STALE] >= 1
    assert sum(r[M.ASYNC_DROPPED_STALE] for r in rows) >= 1
    # A dropped batch's B·G = 8 completions were scored: counted as scored and as dropped stale.
    assert all(r[M.DROPPED_STALE] == 8 * r[M.ASYNC_DROPPED_STALE] for r in rows)
    for r in rows:
        assert r[M.SCORED_COMPLETIONS] == r[M.TRAINED_COMPLETIONS] + sum(r[k] for k in M.DROPPED_KEYS)


def test_the_tiny_model_learns_its_demo_under_async(tmp_path):
    run = run_here(["experiment=tiny_demo", *QUIET, *ASYNC], tmp_path / "run")
    rewards = [r[M.REWARD_MEAN] for r in read_metrics(run)]
    assert len(rewards) == 40
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last > first + 0.3, (first, last)


def test_async_with_lora_sends_merged_weights(tmp_path):
    """lora=default: the worker is a plain model and receives W + (alpha/r)·B·A; at max_staleness=0 the run
    equals the synchronous LoRA run."""
    args = [*FAST, *QUIET, "lora=default", "trainer.lr=3e-3", "trainer.max_steps=3"]
    sync = in_process(args, tmp_path / "sync")
    run = run_here([*args, *ASYNC, "rollout.max_staleness=0"], tmp_path / "async")
    # The merge rounds differently from PEFT's own forward only through the bf16 sampling copy, which both
    # runs use the same way (docs/lora.md): the samples and so every metric agree.
    a, b = read_metrics(sync), read_metrics(run)
    for ra, rb in zip(a, b, strict=True):
        for key, value in comparable(ra).items():
            assert rb[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key


def start(args: list[str], run_dir: Path, log: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [GRPO_RUN, *args, f"hydra.run.dir={run_dir}"],
        cwd=REPO,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        text=True,
        env=dict(os.environ),
    )


def wait_for(condition, proc: subprocess.Popen, log: Path, timeout: float = 180) -> None:
    deadline = time.time() + timeout
    while not condition():
        assert proc.poll() is None, log.read_text()
        assert time.time() < deadline, log.read_text()
        time.sleep(0.2)


def steps_logged(run_dir: Path) -> int:
    metrics = run_dir / "metrics.jsonl"
    return metrics.read_text().count("\n") if metrics.exists() else 0


def worker_pid(log: Path) -> int | None:
    found = re.search(r"generation worker pid (\d+)", log.read_text())
    return int(found.group(1)) if found else None


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


def test_sigterm_saves_exits_75_stops_the_worker_and_resume_continues(tmp_path):
    run_dir, log = tmp_path / "run", tmp_path / "log"
    args = [*FAST, *QUIET, *ASYNC, "trainer.max_steps=100000"]
    proc = start(args, run_dir, log)
    wait_for(lambda: steps_logged(run_dir) >= 2, proc, log)
    pid = worker_pid(log)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == EXIT_PREEMPTED, log.read_text()
    assert pid is not None and not alive(pid)
    stopped_at = read_metrics(run_dir)[-1]["step"]
    saved = run_dir / checkpoint.CHECKPOINTS / checkpoint.step_name(stopped_at)
    assert checkpoint.read_state(saved).step == stopped_at
    proc, _ = run_cli([*args[:-1], f"trainer.max_steps={stopped_at + 2}", "resume=auto"], tmp_path)
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, stopped_at + 3))  # nothing trained twice or skipped
    # The batch in flight is sampled again, by the checkpoint's weights: the first resumed step is on-policy.
    assert rows[stopped_at][M.ASYNC_STALENESS_MAX] == 0


def test_a_dead_worker_ends_the_run_with_exit_1_naming_it_and_saving_the_last_step(tmp_path):
    run_dir, log = tmp_path / "run", tmp_path / "log"
    args = [*FAST, *QUIET, *ASYNC, "trainer.max_steps=100000"]
    proc = start(args, run_dir, log)
    wait_for(lambda: steps_logged(run_dir) >= 1 and worker_pid(log) is not None, proc, log)
    os.kill(worker_pid(log), signal.SIGKILL)
    t = time.time()
    assert proc.wait(timeout=60) == 1, log.read_text()
    assert time.time() - t < 60  # bounded by the liveness poll, not rollout.timeout_s
    text = log.read_text()
    assert "generation worker" in text and "died" in text, text
    assert "resume with resume=auto" in text, text


def test_the_worker_exits_when_the_trainer_is_killed(tmp_path):
    run_dir, log = tmp_path / "run", tmp_path / "log"
    proc = start([*FAST, *QUIET, *ASYNC, "trainer.max_steps=100000"], run_dir, log)
    wait_for(lambda: steps_logged(run_dir) >= 1 and worker_pid(log) is not None, proc, log)
    pid = worker_pid(log)
    proc.kill()  # SIGKILL: no cleanup runs in the trainer
    proc.wait(timeout=30)
    deadline = time.time() + 30
    while alive(pid) and time.time() < deadline:
        time.sleep(0.2)
    assert not alive(pid)


def test_two_zero2_ranks_train_on_their_shares_of_one_workers_batches(tmp_path):
    """distributed=zero2 on 2 CPU ranks with the generation worker beside rank 0: it samples each step's
    prompts with the global seeds and rank 0 scatters the shares. max_staleness=0 equals the synchronous
    2-rank run metric for metric (each rank got the groups its synchronous self samples, and the step's
    metrics the worker's counts once); at 1 the steps after the first train one step off."""
    from tests.builders import ZERO2, hook_env, run_in

    args = [*LEARN, "trainer.max_steps=3", "trainer.micro_batch_size=2", *ZERO2]

    def run(name: str, extra: list[str]) -> list[dict]:
        proc = run_in(tmp_path / name, [*args, *extra], hook_env())
        assert proc.returncode == 0, proc.stdout + proc.stderr
        (run_dir,) = [p for p in (tmp_path / name / "outputs" / "runs").glob("*/*") if p.is_dir()]
        return read_metrics(run_dir)

    sync = run("sync", [])
    zero = run("zero", [*ASYNC, "rollout.max_staleness=0"])
    assert [comparable(r) for r in zero] == [comparable(r) for r in sync]
    # One step off, with dynamic sampling: the worker fills the whole step, then it is split.
    one = run("one", [*ASYNC, "grpo.filter_zero_std=true"])
    assert [r[M.ASYNC_STALENESS_MAX] for r in one] == [0, 1, 1]
    assert all(r[M.ASYNC_DROPPED_STALE] == 0 and r[M.GENERATION_ROUNDS] >= 1 for r in one)
