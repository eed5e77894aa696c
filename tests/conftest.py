"""Shared test set-up: one thread, no network, a per-session cache for the tiny model."""

import os
from pathlib import Path

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_MODE", "offline")

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"


@pytest.fixture(scope="session", autouse=True)
def _cache_dir(tmp_path_factory):
    """Build the tiny model once per session, in a private cache, and point every run at it."""
    cache = os.environ.get("GRPO_RUN_CACHE") or str(tmp_path_factory.mktemp("grpo-cache"))
    os.environ["GRPO_RUN_CACHE"] = cache
    return Path(cache)


@pytest.fixture(autouse=True)
def _no_stop_carried_over():
    """Every test starts with no stop requested: a test that sends this process a stop signal leaves
    the process-wide flag set (as a real run keeps it to its end), and the next test on the same worker
    would then stop at its first stop point, depending on how xdist shared the tests out."""
    from grpo_run.safety import stop

    stop.reset()
    yield
    stop.reset()


# `make test` runs two pytest workers (pytest-xdist, --dist loadgroup). Modules in one group run on
# one worker, one test at a time: the sandbox tests check that no sandbox child of this checkout is
# left anywhere on the machine (a second worker's live children would look leaked), and the SmolLM2 and
# vLLM tests hold several GB each (two at once would press the 24 GB these machines have).
SERIAL_GROUPS = {
    "sandbox": {
        "test_sandbox.py",
        "test_cli_code_exec.py",
        "test_code.py",
        "test_code_reward_forgery.py",
        "test_python_tool.py",
        "test_readme_examples.py",  # README's examples include reward=code_exec
    },
    "large_models": {"test_smollm2.py", "test_vllm.py"},
    # A module whose tests share an expensive module-scoped run (a 2-rank reference, a LoRA run): on one
    # worker it is made once, where two workers would each make their own.
    "rank_faults": {"test_rank_faults.py"},
    "lora": {"test_lora.py"},
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        for group, modules in SERIAL_GROUPS.items():
            if item.path.name in modules:
                item.add_marker(pytest.mark.xdist_group(group))
