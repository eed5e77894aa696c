"""logger=wandb with the real wandb client, offline: the `.wandb` file read back holds what metrics.jsonl holds.

No network: WANDB_MODE=offline (conftest), or no API key at all with W&B's host pointed at a closed
local port, so that even a wrong mode choice could not reach the internet.
"""

import json
import os
import subprocess
import uuid

import pytest
import yaml
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from omegaconf import open_dict

from grpo_run import metrics as M
from grpo_run.tracking.wandb_run import RUN_ID_FILE, choose_mode, job_name, with_hydra_identity
from tests.helpers import FAST, GRPO_RUN, REPO, read_metrics, run_cli
from tests.wandb_reader import config_values, history, read_records, run_files, run_record

WANDB = ["logger=wandb", "grpo.beta=0.04"]
SERIES = [M.REWARD_MEAN, M.KL, M.CLIP_FRACTION, M.FRAC_REWARD_ZERO_STD]


def no_key_env(tmp_path) -> dict[str, str]:
    """An environment with no W&B key anywhere and no WANDB_MODE: grpo-run must pick offline itself."""
    env = {k: v for k, v in os.environ.items() if k not in ("WANDB_MODE", "WANDB_API_KEY")}
    home = tmp_path / "home"
    home.mkdir()
    return {**env, "HOME": str(home), "NETRC": str(home / ".netrc"), "WANDB_BASE_URL": "http://127.0.0.1:9"}


def test_offline_run_logs_every_step_like_metrics_jsonl(tmp_path):
    run_dir = tmp_path / "run"
    args = [*FAST, *WANDB, "logger.log_completions_every=2", f"hydra.run.dir={run_dir}"]
    proc = subprocess.run(
        [GRPO_RUN, *args], cwd=REPO, capture_output=True, text=True, timeout=300, env=no_key_env(tmp_path)
    )
    assert proc.returncode == 0, proc.stderr
    # One line says why it is offline and where the files are.
    lines = [line for line in proc.stderr.splitlines() if line.startswith("W&B offline")]
    assert len(lines) == 1 and "no W&B API key" in lines[0] and str(run_dir / "wandb") in lines[0], lines

    files = run_files(run_dir)
    assert len(files) == 1
    records = read_records(files[0])
    rows, jsonl = history(records), read_metrics(run_dir)
    assert [r["step"] for r in rows] == [r["step"] for r in jsonl] == [1, 2]
    for row, expected in zip(rows, jsonl):
        for key, value in expected.items():  # every key of every step, the same numbers
            assert row[key] == pytest.approx(value, rel=1e-12, abs=0), (key, row[key], value)
        for key in SERIES:
            assert key in row

    # `step` is the x-axis of every key.
    metric_defs = [r.metric for r in records if r.WhichOneof("record_type") == "metric"]
    assert any(m.glob_name == "*" and m.step_metric == "step" for m in metric_defs), metric_defs

    # A completions table on step 2 only: B*G rows, one column per reward function, the advantage.
    assert "completions/_type" not in rows[0]
    assert rows[1]["completions/_type"] == "table-file" and rows[1]["completions/nrows"] == 2 * 4
    table_path = next(files[0].parent.glob("files/media/table/completions_*.table.json"))
    table = json.loads(table_path.read_text())
    assert table["columns"] == [
        "step",
        "prompt",
        "completion",
        "gold",
        "target_char_fraction",
        "reward",
        "advantage",
    ]
    assert {row[0] for row in table["data"]} == {2}
    advantages = [row[-1] for row in table["data"]]
    assert sum(advantages) == pytest.approx(0, abs=1e-5)  # normalized within each group

    run = run_record(records)
    assert run.run_id == (run_dir / RUN_ID_FILE).read_text().strip()
    assert {"model=tiny", "reward=target_char", "logger=wandb"} <= set(run.tags)
    config = config_values(records)
    assert config["grpo"]["beta"] == 0.04 and config["grpo"]["advantage_mode"] == "normalized"
    assert config["trainer"]["max_steps"] == 2


def test_api_key_is_written_nowhere_and_a_rerun_keeps_the_run_id(tmp_path):
    key = f"sk-test-{uuid.uuid4().hex}"
    env = {"WANDB_API_KEY": key, "WANDB_MODE": "offline"}  # offline: nothing is sent
    args = [*FAST, *WANDB, "trainer.max_steps=1"]
    run_cli(args, tmp_path, env=env)
    proc, run_dir = run_cli(args, tmp_path, env=env)  # the same run dir again: the same W&B run
    assert "W&B offline (WANDB_MODE=offline)" in proc.stderr
    ids = [run_record(read_records(f)).run_id for f in run_files(run_dir)]
    assert len(ids) == 2 and set(ids) == {(run_dir / RUN_ID_FILE).read_text().strip()}
    written = [p for p in run_dir.rglob("*") if p.is_file()]
    assert any(p.suffix == ".wandb" for p in written) and any(".hydra" in p.parts for p in written)
    leaks = [p for p in written if key.encode() in p.read_bytes()]
    assert leaks == []
    assert key not in json.dumps(config_values(read_records(run_files(run_dir)[0])))
    assert key not in proc.stdout + proc.stderr
    job = subprocess.run(
        [GRPO_RUN, "--cfg", "job", *WANDB],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **env},
    )
    assert job.returncode == 0 and "wandb: true" in job.stdout and key not in job.stdout


def test_mode_follows_wandb_mode_then_config_then_the_api_key(tmp_path, monkeypatch):
    from grpo_run.config.schema import WandbMode

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("NETRC", str(tmp_path / ".netrc"))
    monkeypatch.delenv("WANDB_BASE_URL", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    assert choose_mode(None)[0] == "offline"
    assert choose_mode(WandbMode.DISABLED)[0] == "disabled"
    (tmp_path / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password from-netrc\n")
    assert choose_mode(None)[0] == "online"
    (tmp_path / ".netrc").write_text("machine example.com\n  login user\n  password other\n")
    assert choose_mode(None)[0] == "offline"
    monkeypatch.setenv("WANDB_API_KEY", "sk-test-x")
    assert choose_mode(None)[0] == "online"
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert choose_mode(WandbMode.ONLINE) == ("offline", "WANDB_MODE=offline")


def test_job_name_keeps_only_the_swept_keys():
    task = ["model=tiny", "grpo.beta=0.04", "trainer.max_steps=2", "grpo.epsilon=0.2", "grpo.group_size=8"]
    swept = ["grpo.beta", "grpo.epsilon", "grpo.group_size"]
    assert job_name(task, swept) == "beta=0.04,epsilon=0.2,group_size=8"
    assert job_name(task, []) is None


def test_a_rank_started_inside_a_multirun_job_dir_keeps_the_sweep_identity(tmp_path):
    """A multi-GPU job reruns its overrides as plain runs in the job's dir: same group, same name."""
    from grpo_run.config import register_configs, to_config

    sweep = tmp_path / "2026-01-02" / "10-11-12"
    (sweep / "1").mkdir(parents=True)
    task = ["model=tiny", "grpo.beta=0,0.04", "grpo.group_size=2,4"]
    (sweep / "multirun.yaml").write_text(yaml.safe_dump({"hydra": {"overrides": {"task": task}}}))
    register_configs()
    overrides = ["model=tiny", "grpo.beta=0.04", "grpo.group_size=2", "trainer.micro_batch_size=4"]
    overrides += ["logger.tags=[mine]"]
    with initialize_config_dir(str(REPO / "conf"), version_base="1.3"):
        raw = compose("config", overrides=overrides, return_hydra_config=True)
    HydraConfig.instance().set_config(raw)
    try:
        with open_dict(raw):
            del raw["hydra"]
            raw.run_dir = str(sweep / "1")
        lg = with_hydra_identity(to_config(raw)).logger
    finally:
        HydraConfig.instance().cfg = None
    assert lg.group == "2026-01-02_10-11-12" and lg.name == "beta=0.04,group_size=2"
    assert lg.tags[0] == "mine" and "model=tiny" in lg.tags and "logger=wandb" in lg.tags
