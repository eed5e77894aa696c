"""A real run on code: `grpo-run model=tiny data=humaneval reward=code_exec` (rewards are 0 for the tiny
model; the point is the plumbing: the sandbox's log line and the outcome counts in metrics.jsonl)."""

import pytest

from grpo_run import metrics as M
from tests.conftest import SHARED_DATA
from tests.helpers import FAST, read_metrics, run_cli

pytestmark = pytest.mark.skipif(
    not (SHARED_DATA / "humaneval_test.jsonl.gz").exists(),
    reason="needs ../shared/data/humaneval_test.jsonl.gz",
)


def test_two_steps_on_humaneval_count_every_outcome(tmp_path):
    # The tiny model takes 1,024 positions; one HumanEval prompt (1,172 tokens) is skipped and counted.
    args = [*FAST, "data=humaneval", "reward=code_exec", "logger=console", "data.max_prompt_tokens=1000"]
    args += [f"data.local_dir={SHARED_DATA}"]  # the preset's file there, not the hub (tests have no network)
    args += ["eval.every_steps=2", "eval.num_prompts=2", "eval.samples_per_prompt=2"]
    proc, run_dir = run_cli(args, tmp_path)
    assert "code_exec sandbox: " in proc.stdout + proc.stderr  # which isolation ran, in the run's log
    rows = [r for r in read_metrics(run_dir) if M.REWARD_MEAN in r]
    assert len(rows) == 2
    completions = 2 * 4  # prompts_per_step * group_size
    for row in rows:
        counts = {key: row[key] for key in M.CODE_EXEC_OUTCOMES}
        assert sum(counts.values()) == completions, counts  # every completion counted once, by kind
        assert counts["train/rewards/code_exec/sandbox_failure"] == 0
        assert row[M.REWARD_UNSCORABLE] == 0
        assert row["train/rewards/code_exec_mean"] == row[M.REWARD_MEAN]
    evals = [r for r in read_metrics(run_dir) if M.EVAL_ACCURACY in r]
    assert evals and all(0.0 <= r[M.EVAL_ACCURACY] <= 1.0 for r in evals)  # scored by code_exec
