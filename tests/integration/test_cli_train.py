"""The real `grpo-run` command on the tiny model: it trains, logs every key, and fails clearly."""

import json
import math
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

import grpo_run.trainer as trainer
from grpo_run import metrics as M
from grpo_run.models.tiny import ensure_tiny_model
from tests.builders import QUIET, config, run_here
from tests.helpers import FAST, GRPO_RUN, REPO, read_metrics, run_cli


def test_train_writes_every_metric_and_changes_parameters(tmp_path, _cache_dir):
    proc, run_dir = run_cli([*FAST, "grpo.beta=0.04", "trainer.lr=1e-3"], tmp_path)
    assert str(run_dir) in proc.stderr  # the run dir is printed
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        for key in [*M.ALWAYS, M.KL, M.REWARD_FN_MEAN.format("target_char_fraction")]:
            assert key in row, key
            assert isinstance(row[key], float) and math.isfinite(row[key]), (key, row[key])
    assert (run_dir / "config_resolved.yaml").exists()
    before = load_file(ensure_tiny_model(_cache_dir) / "model.safetensors")
    after = load_file(run_dir / "final" / "model.safetensors")
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert len(changed) >= len(before) // 2


def test_same_seed_gives_same_first_losses(tmp_path):
    """In this process (the command's own reproducibility is the resume tests'): five short runs."""

    def run(name: str, *extra: str) -> list[dict]:
        trainer.train(config([*FAST, *QUIET, *extra], tmp_path / name))
        return read_metrics(tmp_path / name)

    a, b, c = run("a", "trainer.seed=7"), run("b", "trainer.seed=7"), run("c", "trainer.seed=8")
    for key in [M.LOSS, M.REWARD_MEAN, M.ENTROPY]:
        assert [r[key] for r in a] == [r[key] for r in b]
    assert [r[M.REWARD_MEAN] for r in a] != [r[M.REWARD_MEAN] for r in c]
    # Each micro-batch here is one prompt's group: the shared-prompt forward (on by default) against
    # the plain one gives the same samples and, to float32 rounding, the same losses.
    d = run("d", "trainer.seed=7", "backend.shared_prompt_forward=false")
    assert [r[M.REWARD_MEAN] for r in d] == [r[M.REWARD_MEAN] for r in a]
    for key in [M.LOSS, M.ENTROPY, M.GRAD_NORM]:
        assert [r[key] for r in d] == pytest.approx([r[key] for r in a], rel=1e-5, abs=1e-7), key
    # The LM head fused into the chunked log-softmax (on by default) against logits first: the same.
    e = run("e", "trainer.seed=7", "backend.fused_lm_head=false")
    assert [r[M.REWARD_MEAN] for r in e] == [r[M.REWARD_MEAN] for r in a]
    for key in [M.LOSS, M.ENTROPY, M.GRAD_NORM]:
        assert [r[key] for r in e] == pytest.approx([r[key] for r in a], rel=1e-5, abs=1e-7), key


def test_casting_weights_once_per_step_changes_no_bit_of_a_bf16_run(tmp_path):
    """Under bf16 autocast the update casts each weight once per optimizer step (μ = 2: two optimizer
    steps a step, so a cast kept past one would show); the run is the one autocast alone gives."""
    bf16 = [
        *FAST,
        "model.autocast_bf16=true",
        "grpo.num_iterations=2",
        "trainer.lr=1e-3",
        "trainer.max_steps=3",
    ]
    # In this process: the two settings' arithmetic is under test, not the command.
    once = read_metrics(run_here([*bf16, *QUIET], tmp_path / "once"))
    every = read_metrics(run_here([*bf16, *QUIET, "backend.cast_weights_once=false"], tmp_path / "every"))
    for key in [M.REWARD_MEAN, M.LOSS, M.GRAD_NORM, M.ENTROPY, M.CLIP_FRACTION]:
        assert [r[key] for r in once] == [r[key] for r in every], key
    assert all(r[M.GRAD_NORM] > 0 for r in once)  # the weights moved: stale casts would differ


def test_multirun_grid_leaves_one_dir_per_job(tmp_path):
    sweep = tmp_path / "sweep"
    proc, _ = run_cli(
        ["-m", *FAST, "grpo.beta=0,0.04", "grpo.group_size=2,4", f"hydra.sweep.dir={sweep}"], tmp_path
    )
    jobs = sorted(p for p in sweep.iterdir() if p.is_dir() and p.name.isdigit())
    assert len(jobs) == 4
    for job in jobs:
        assert len(read_metrics(job)) == 2
    overrides = {(job / ".hydra" / "overrides.yaml").read_text() for job in jobs}
    assert len(overrides) == 4


def test_tiny_demo_preset_learns_its_task_visibly(tmp_path):
    """README's first example: `experiment=tiny_demo` (reward = share of 'a' characters) learns by RL alone."""
    rows = read_metrics(run_cli(["experiment=tiny_demo", "logger=console", "trainer.seed=0"], tmp_path)[1])
    assert len(rows) == 40
    first = sum(r[M.REWARD_MEAN] for r in rows[:5]) / 5
    last = sum(r[M.REWARD_MEAN] for r in rows[-5:]) / 5
    # Measured on seeds 0, 1, 2: ~0.06 over the first five steps, 0.99-1.0 over the last five.
    assert first < 0.2 and last > 0.8, (first, last)


def test_help_and_cfg_job():
    help_out = subprocess.run([GRPO_RUN, "--help"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert help_out.returncode == 0 and "advantage_mode" in help_out.stdout
    # Our description and examples (conf/hydra/help/grpo_run.yaml), not Hydra's generic "powered by Hydra".
    assert help_out.stdout.startswith("grpo-run: GRPO") and "powered by Hydra" not in help_out.stdout
    assert "grpo-run experiment=tiny_demo" in help_out.stdout and "Exit codes" in help_out.stdout
    job = subprocess.run(
        [GRPO_RUN, "--cfg", "job", "grpo.beta=0.04"], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert job.returncode == 0 and "beta: 0.04" in job.stdout


@pytest.mark.parametrize(
    "override,key,suggestion",
    [
        ("grpo.group_size=1", "grpo.group_size", None),  # our validation
        ("grpo.gorup_size=4", "gorup_size", "Did you mean grpo.group_size?"),  # Hydra: unknown key
        ("grpo.betta=0.1", "grpo.betta", "Did you mean grpo.beta"),  # or grpo.delta
        ("+grpo.betta=0.1", "grpo.betta", "did you mean grpo.beta"),  # appended: refused by to_config
        ("model=nope", "model", None),  # Hydra: unknown group option, nothing close
        ("model=tinny", "model/tinny", "Did you mean model=tiny?"),
        ("grpo.beta=[", "'['", None),  # Hydra: the override does not parse
        ("grpo.beta=abc", "grpo.beta", None),  # Hydra: wrong type
    ],
)
def test_bad_override_exits_2_naming_the_key(tmp_path, override, key, suggestion):
    proc, run_dir = run_cli([*FAST, override], tmp_path, check=False)
    assert proc.returncode == 2, proc.stderr
    assert "grpo-run: invalid config" in proc.stderr and key in proc.stderr
    assert suggestion is None or suggestion in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (run_dir / "metrics.jsonl").exists()  # nothing ran


def test_a_bad_option_in_one_job_of_a_sweep_exits_2_before_any_job_runs(tmp_path):
    """Hydra's sweeper composes every job of the batch first: the second job's option does not exist."""
    proc, _ = run_cli(
        ["-m", *FAST, "trainer.max_steps=1", "model=tiny,tinny", f"hydra.sweep.dir={tmp_path / 'sweep'}"],
        tmp_path,
        check=False,
    )
    assert proc.returncode == 2, proc.stderr
    assert "Did you mean model=tiny?" in proc.stderr
    assert not (tmp_path / "sweep" / "0" / "metrics.jsonl").exists()


def test_malformed_data_file_names_file_and_line(tmp_path):
    data = tmp_path / "bad.jsonl"
    data.write_text(json.dumps({"question": "1+1?", "answer": "2"}) + "\n{not json\n")
    proc, _ = run_cli([*FAST, "data=jsonl", f"data.train_path={data}"], tmp_path, check=False)
    assert proc.returncode == 1  # the run failed; the config was valid
    assert f"{data}:2" in proc.stderr


def test_offline_model_id_fails_with_a_clear_message(tmp_path):
    proc, _ = run_cli(
        [*FAST, "model=pretrained", "model.path=no-such-org/no-such-model"], tmp_path, check=False
    )
    assert proc.returncode != 0
    assert "no-such-org/no-such-model" in proc.stderr and "HF_HUB_OFFLINE" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_ctrl_c_stops_cleanly_and_keeps_finished_steps(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [GRPO_RUN, *FAST, "trainer.max_steps=100000", f"hydra.run.dir={run_dir}"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # A shell starts background jobs with SIGINT ignored, and Python then keeps it ignored: give the
        # run the default disposition, as a terminal would, whatever launched the test suite.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.time() + 120
    while time.time() < deadline and not (
        (run_dir / "metrics.jsonl").exists() and (run_dir / "metrics.jsonl").read_text().count("\n") >= 2
    ):
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "interrupted" in err
    assert len(read_metrics(run_dir)) >= 2


def test_a_single_process_run_never_imports_deepspeed_nor_peft(tmp_path):
    """transformers' save_pretrained would import deepspeed (through accelerate) just for an isinstance
    check; peft is imported where an adapter is made or read. Each costs every run's start-up."""
    args = ["grpo-run", *FAST, "logger=console", f"hydra.run.dir={tmp_path / 'run'}"]
    probe = (
        "import atexit, sys\n"
        "atexit.register(lambda: print('deepspeed imported:', 'deepspeed' in sys.modules, file=sys.stderr))\n"
        "atexit.register(lambda: print('peft imported:', 'peft' in sys.modules, file=sys.stderr))\n"
        f"sys.argv = {args!r}\n"
        "from grpo_run.cli import main\n"
        "main()\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=300, check=True
    )
    assert "deepspeed imported: False" in proc.stderr, proc.stderr
    assert "peft imported: False" in proc.stderr, proc.stderr
    assert "Setting accelerator to CPU" not in proc.stderr
    assert (tmp_path / "run" / "final" / "model.safetensors").exists()  # the save that used to import it


def test_eval_of_a_run_dir_uses_that_runs_model_settings(tmp_path):
    """`mode=eval eval.checkpoint=<tiny run>` without `model=tiny` scores as `model=tiny` does."""
    train_dir = run_here([*FAST, "logger=console"], tmp_path / "train" / "run")  # the run evaluated
    evaluate = ["mode=eval", f"eval.checkpoint={train_dir}", "trainer.device=cpu", "logger=console"]
    evaluate += [
        "eval.num_prompts=8",
        "eval.samples_per_prompt=2",
        "eval.max_new_tokens=8",
        "eval.batch_size=8",
    ]
    plain, plain_dir = run_cli(evaluate, tmp_path / "plain")  # the default model group is SmolLM2's
    explicit, explicit_dir = run_cli([*evaluate, "model=tiny"], tmp_path / "explicit")
    assert "autocast_bf16=False" in plain.stderr and "config_resolved.yaml" in plain.stderr, plain.stderr
    values = [json.loads((d / "eval_summary.json").read_text())["value"] for d in (plain_dir, explicit_dir)]
    for v in values:
        v.pop(M.EVAL_S, None)  # timing
    assert values[0] == values[1]
