"""The rollout group: sync by default, async's knobs checked by name, the combinations it does not run refused
naming both keys."""

import pytest

from grpo_run.config import ConfigError
from grpo_run.config.schema import RolloutMode
from tests.builders import compose_config


def test_the_default_is_the_synchronous_loop():
    cfg = compose_config(["model=tiny"])
    assert cfg.rollout.mode == RolloutMode.SYNC
    assert cfg.rollout.max_staleness == 1 and cfg.rollout.lockstep


def test_rollout_async_takes_its_knobs():
    cfg = compose_config(["model=tiny", "rollout=async", "rollout.max_staleness=2", "rollout.threads=2"])
    assert cfg.rollout.mode == RolloutMode.ASYNC
    assert (cfg.rollout.max_staleness, cfg.rollout.threads) == (2, 2)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["rollout.max_staleness=-1"], r"rollout\.max_staleness=-1: must be >= 0"),
        (["rollout.threads=0"], r"rollout\.threads=0: must be >= 1"),
        (["rollout.timeout_s=0"], r"rollout\.timeout_s=0\.0: must be > 0"),
    ],
)
def test_bad_async_settings_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        compose_config(["model=tiny", "eval.every_steps=0", "rollout=async", *overrides])


def test_async_takes_the_vllm_engine():
    cfg = compose_config(["model=tiny", "eval.every_steps=0", "rollout=async", "generation=vllm"])
    assert cfg.rollout.mode == RolloutMode.ASYNC and cfg.generation.engine.value == "vllm"


def test_sync_ignores_the_async_knobs():
    """rollout=sync never reads them: a value async would refuse is no error here."""
    assert compose_config(["model=tiny", "rollout.max_staleness=-1"]).rollout.mode == RolloutMode.SYNC
