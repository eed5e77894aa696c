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
