"""The default run directory: claimed with an atomic mkdir, so concurrent runs never share one."""

import multiprocessing
import re
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from grpo_run.config import register_configs
from grpo_run.config import run_dir as rd
from tests.helpers import REPO


@pytest.fixture(autouse=True)
def _fresh_memo(monkeypatch):
    monkeypatch.setattr(rd, "_claimed", {})


def test_a_free_name_is_created_and_kept_for_the_process(tmp_path):
    base = str(tmp_path / "runs" / "2026-11-30" / "21-44-00-127143")
    assert rd.claim_fresh_dir(base) == base
    assert Path(base).is_dir()
    assert rd.claim_fresh_dir(base) == base  # asked again (Hydra resolves twice): the same dir


def test_a_taken_name_gets_the_next_free_suffix(tmp_path):
    base = tmp_path / "21-44-00-127143"
    base.mkdir()  # another run has it
    (tmp_path / "21-44-00-127143-1").mkdir()  # and a third run the next one
    assert rd.claim_fresh_dir(str(base)) == f"{base}-2"
    assert not any((tmp_path / "21-44-00-127143-2").iterdir())


def _claim(base: str) -> str:
    return rd.claim_fresh_dir(base)


def test_processes_asking_for_one_name_at_once_each_get_their_own(tmp_path):
    base = str(tmp_path / "same-microsecond")
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(4, maxtasksperchild=1) as pool:  # a new process (an empty memo) per claim
        got = pool.map(_claim, [base] * 8, chunksize=1)
    # 8 claims of one name: the name and -1 ... -7, each exactly once.
    assert sorted(got) == sorted([base] + [f"{base}-{n}" for n in range(1, 8)])


def test_only_a_directory_this_process_claimed_is_given_up(tmp_path):
    mine = rd.claim_fresh_dir(str(tmp_path / "mine"))
    (Path(mine) / ".hydra").mkdir()
    (Path(mine) / ".hydra" / "config.yaml").write_text("a: 1\n")
    users = tmp_path / "given-by-the-user"
    users.mkdir()
    (users / "metrics.jsonl").write_text("{}\n")
    rd.give_up_claim(mine)
    rd.give_up_claim(str(users))
    assert not Path(mine).exists()
    assert (users / "metrics.jsonl").read_text() == "{}\n"


def test_the_default_run_and_sweep_dirs_resolve_through_fresh_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    register_configs()
    with initialize_config_dir(str(REPO / "conf"), version_base="1.3"):
        cfg = compose("config", return_hydra_config=True)
    assert not (tmp_path / "outputs").exists()  # composing alone creates nothing
    raw = OmegaConf.to_container(cfg.hydra, resolve=False)
    assert raw["run"]["dir"].startswith("${fresh_dir:")
    assert raw["sweep"]["dir"].startswith("${fresh_dir:")
    run_dir = Path(cfg.hydra.run.dir)
    assert run_dir.is_dir() and run_dir.parts[:2] == ("outputs", "runs")
    assert cfg.hydra.run.dir == str(run_dir)  # resolved again: the same directory, no second one
    assert len(list((tmp_path / "outputs" / "runs").glob("*/*"))) == 1


def test_the_readme_pattern_with_a_nested_timestamp_parses_and_claims(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    register_configs()
    override = 'hydra.run.dir="${fresh_dir:runs/${now:%H-%M-%S}}"'  # as docs/reliability.md writes it
    with initialize_config_dir(str(REPO / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[override], return_hydra_config=True)
    run_dir = Path(cfg.hydra.run.dir)
    assert run_dir.parent == Path("runs") and run_dir.is_dir()
    assert re.fullmatch(r"\d{2}-\d{2}-\d{2}", run_dir.name), run_dir
