"""`make help` lists every documented target, digits in the name included (bench-smollm2)."""

import re
import shutil
import subprocess

import pytest

from tests.conftest import REPO


@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
def test_make_help_lists_every_documented_target():
    documented = re.findall(r"^([^\s:#]+):[^\n]*## ", (REPO / "Makefile").read_text(), flags=re.M)
    assert "bench-smollm2" in documented
    out = subprocess.run(["make", "-s", "help"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    listed = re.findall(r"^\s+(?:\x1b\[36m)?(\S+?)(?:\x1b\[0m)?\s", out, flags=re.M)
    assert listed == documented
