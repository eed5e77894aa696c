"""Sweeps: a 2x2 multirun in one W&B group and its report; the sweep presets; Slurm through submitit."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from grpo_run.tracking.report import PNG_NAME, build_table, load_sweep
from tests.helpers import FAST, GRPO_RUN, REPO, read_metrics, run_cli
from tests.wandb_reader import read_records, run_files, run_record

REPORT = str(Path(sys.executable).parent / "grpo-run-report")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def job_dirs(sweep: Path) -> list[Path]:
    return sorted((p for p in sweep.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name))


def cfg_hydra(*overrides: str) -> str:
    proc = subprocess.run(
        [GRPO_RUN, "--cfg", "hydra", *overrides], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_2x2_multirun_is_one_wandb_group_and_one_report(tmp_path):
    sweep = tmp_path / "sweep"
    args = [
        "-m",
        *FAST,
        "logger=wandb",
        "grpo.beta=0,0.04",
        "grpo.group_size=2,4",
        f"hydra.sweep.dir={sweep}",
    ]
    run_cli([*args, "logger.console=false"], tmp_path)
    jobs = job_dirs(sweep)
    assert len(jobs) == 4
    runs = [run_record(read_records(run_files(job)[0])) for job in jobs]
    assert len({r.run_group for r in runs}) == 1 and runs[0].run_group.endswith("sweep")
    assert len({r.run_id for r in runs}) == 4
    names = [r.display_name for r in runs]
    assert set(names) == {f"beta={b},group_size={g}" for b in ("0", "0.04") for g in (2, 4)}
    for job, name in zip(jobs, names):  # each run is named after its own job's values
        overrides = (job / ".hydra" / "overrides.yaml").read_text()
        assert all(f"grpo.{part}" in overrides for part in name.split(","))

    report = subprocess.run([REPORT, str(sweep)], capture_output=True, text=True, timeout=120)
    assert report.returncode == 0, report.stderr
    for name in names:
        assert name in report.stdout
    png = sweep / PNG_NAME
    assert png.read_bytes().startswith(PNG_MAGIC) and png.stat().st_size > 10_000
    loaded = load_sweep(sweep)
    assert build_table(loaded).row_count == 4
    assert sorted((j.beta, j.group_size) for j in loaded) == [(0, 2), (0, 4), (0.04, 2), (0.04, 4)]
    assert [j.label for j in loaded] == names  # the report names jobs as W&B does
    for job in loaded:
        assert job.final("train/reward_mean") == read_metrics(job.path)[-1]["train/reward_mean"]


@pytest.mark.slow
def test_beta_eps_g_preset_sweeps_eight_jobs(tmp_path):
    sweep = tmp_path / "sweep"
    # A command-line value of a swept key replaces the preset's list: leave G to the preset.
    fast = [a for a in FAST if not a.startswith("grpo.group_size")]
    args = ["-m", "sweep=beta_eps_g", *fast, "trainer.max_steps=1", f"hydra.sweep.dir={sweep}"]
    run_cli([*args, "logger=console", "logger.console=false"], tmp_path)
    jobs = load_sweep(sweep)
    assert len(jobs) == 8
    grid = {(j.beta, j.epsilon, j.group_size) for j in jobs}
    assert grid == {(b, e, g) for b in (0, 0.04) for e in (0.1, 0.2) for g in (4, 8)}
    for job in jobs:  # G completions per prompt: the micro-batch of 4 divides 2 x G for each G
        assert len(job.rows) == 1 and job.label.count("=") == 3


def test_group_size_that_breaks_the_micro_batch_fails_before_any_job_trains(tmp_path):
    sweep = tmp_path / "sweep"
    args = ["-m", *FAST, "grpo.group_size=3,4", f"hydra.sweep.dir={sweep}"]  # 2 x 3 = 6 completions, micro 4
    proc, _ = run_cli(args, tmp_path, check=False)
    assert proc.returncode == 2
    assert "trainer.micro_batch_size=4" in proc.stderr and "grpo.group_size" in proc.stderr
    assert not list(sweep.rglob("metrics.jsonl"))


def test_slurm_preset_shows_the_sbatch_parameters():
    pytest.importorskip(
        "hydra_plugins.hydra_submitit_launcher", reason="the slurm extra: pip install -e .[slurm]"
    )
    out = cfg_hydra("hydra/launcher=slurm", "hydra.launcher.partition=gpu", "hydra.launcher.timeout_min=90")
    for line in [
        "SlurmLauncher",
        "partition: gpu",
        "timeout_min: 90",
        "gpus_per_node: ${distributed.nproc_per_node}",
        "nodes: ${distributed.nnodes}",
        "tasks_per_node: 1",
        "max_num_timeout: 3",
        "requeue: true",
    ]:
        assert line in out, line
    from hydra import compose, initialize_config_dir

    from grpo_run.config import register_configs

    register_configs()
    overrides = ["hydra/launcher=slurm", "distributed=zero2", "distributed.nproc_per_node=8"]
    with initialize_config_dir(str(REPO / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=overrides, return_hydra_config=True)
    assert cfg.hydra.launcher.gpus_per_node == 8 and cfg.hydra.launcher.nodes == 1


@pytest.mark.slow
def test_submitit_local_runs_a_two_job_sweep(tmp_path):
    pytest.importorskip(
        "hydra_plugins.hydra_submitit_launcher", reason="the slurm extra: pip install -e .[slurm]"
    )
    sweep = tmp_path / "sweep"
    args = ["-m", "hydra/launcher=submitit_local", *FAST, "grpo.beta=0,0.04", f"hydra.sweep.dir={sweep}"]
    run_cli([*args, "logger=console", "logger.console=false"], tmp_path)
    jobs = job_dirs(sweep)
    assert len(jobs) == 2
    for job in jobs:
        assert [r["step"] for r in read_metrics(job)] == [1, 2]
    assert list((sweep / ".submitit").iterdir())  # the jobs really went through submitit


@pytest.mark.skipif(
    importlib.util.find_spec("hydra_plugins.hydra_optuna_sweeper") is None,
    reason="the optuna extra is optional and not installed (pip install -e .[optuna])",
)
def test_optuna_preset_composes():
    out = cfg_hydra("hydra/sweeper=optuna_beta_eps_g")
    assert "OptunaSweeper" in out and "direction: maximize" in out
    assert "grpo.group_size: choice(4, 8)" in out
