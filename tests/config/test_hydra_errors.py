"""Hydra's own composition errors exit 2 with a suggestion; an exception from inside the job stays exit 1."""

import logging
import sys
from dataclasses import dataclass, field

import hydra
import pytest
from hydra.core.config_store import ConfigStore

from grpo_run.config import hydra_errors
from grpo_run.config.hydra_errors import close_matches, did_you_mean_key, job, run_app


@dataclass
class _Inner:
    beta: float = 0.0
    group_size: int = 4


@dataclass
class _Root:
    grpo: _Inner = field(default_factory=_Inner)
    fail: bool = False


ConfigStore.instance().store(name="test_hydra_errors_root", node=_Root)


@hydra.main(version_base="1.3", config_path=None, config_name="test_hydra_errors_root")
@job
def _app(cfg) -> None:
    if cfg.fail:
        raise RuntimeError("the job itself broke")


@pytest.fixture(autouse=True)
def _restore_logging():
    """An in-process Hydra job configures logging (a file handler in its run dir): put back what was there,
    so that later tests never log into a temporary folder that pytest has removed."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    for handler in root.handlers[:]:
        if handler not in handlers:
            root.removeHandler(handler)
            handler.close()
    root.handlers[:] = handlers
    root.setLevel(level)


def _run(monkeypatch, tmp_path, *overrides: str) -> int:
    monkeypatch.setattr(hydra_errors._JobState, "raised", False)
    monkeypatch.setenv("HYDRA_FULL_ERROR", "")  # unset for the test; run_app's own setting is undone after it
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["grpo-run", *overrides, f"hydra.run.dir={tmp_path / 'run'}"])
    with pytest.raises(SystemExit) as exit_info:
        run_app(_app, exit_config_error=2)
    return exit_info.value.code


def test_close_matches_and_key_suggestion():
    assert close_matches("betta", ["beta", "epsilon", "group_size"]) == ["beta"]
    assert did_you_mean_key("grpo.betta", ["beta", "epsilon"]) == "Did you mean grpo.beta?"
    assert did_you_mean_key("modle", ["mode", "model", "trainer"]) == "Did you mean mode or model?"
    assert did_you_mean_key("grpo.zzz", ["beta", "epsilon"]) == ""


def test_unknown_key_exits_2_with_did_you_mean(monkeypatch, tmp_path, capsys):
    assert _run(monkeypatch, tmp_path, "grpo.betta=0.1") == 2
    err = capsys.readouterr().err
    assert "grpo-run: invalid config" in err and "grpo.betta" in err
    assert "Did you mean grpo.beta?" in err
    assert "To append to your config" not in err  # Hydra's hint; the typed schema refuses `+` too


def test_bad_override_syntax_exits_2(monkeypatch, tmp_path, capsys):
    assert _run(monkeypatch, tmp_path, "grpo.beta=[") == 2
    assert "invalid config" in capsys.readouterr().err


def test_an_exception_inside_the_job_exits_1_with_its_traceback(monkeypatch, tmp_path, capsys):
    assert _run(monkeypatch, tmp_path, "fail=true") == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "the job itself broke" in err and "invalid config" not in err


def test_a_valid_config_runs_the_job(monkeypatch, tmp_path):
    monkeypatch.setattr(hydra_errors._JobState, "raised", False)
    monkeypatch.setenv("HYDRA_FULL_ERROR", "")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["grpo-run", f"hydra.run.dir={tmp_path / 'run'}"])
    run_app(_app, exit_config_error=2)  # returns: no SystemExit
    assert (tmp_path / "run" / ".hydra" / "config.yaml").exists()
