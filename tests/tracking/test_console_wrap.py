"""The console wraps at a terminal's width, and never in a log file or a pipe (a path stays one line)."""

import io
import sys

import pytest

from grpo_run.tracking.sinks import stderr_console

PATH = "/runs/" + "x" * 200 + "/run"


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture(autouse=True)
def _auto_detected(monkeypatch):
    """rich decides from the stream alone: no forced terminal, and 80 columns where it asks for a width."""
    for name in ("TTY_COMPATIBLE", "FORCE_COLOR", "NO_COLOR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("COLUMNS", "80")


def test_to_a_file_a_long_line_stays_one_line(monkeypatch):
    log = io.StringIO()
    monkeypatch.setattr(sys, "stderr", log)
    stderr_console().print(f"[bold]grpo-run[/] run dir: {PATH}")
    assert log.getvalue() == f"grpo-run run dir: {PATH}\n"


def test_to_a_terminal_rich_wraps_at_its_width(monkeypatch):
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    console = stderr_console()
    console.print(f"grpo-run run dir: {PATH}", markup=False, highlight=False)
    assert console.width == 80 and not console.soft_wrap
    assert len(terminal.getvalue().splitlines()) > 1  # rich's own wrapping, as before
