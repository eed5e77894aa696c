"""The rollout group: sync by default, async's knobs checked by name, the combinations it does not run refused
naming both keys."""

import re

import pytest
import torch

from grpo_run.algo.enums import RolloutCorrection
from grpo_run.config import ConfigError
from grpo_run.config.schema import RolloutMode
from tests.builders import compose_config


def test_the_default_is_the_synchronous_loop():
    cfg = compose_config(["model=tiny"])
    assert cfg.rollout.mode == RolloutMode.SYNC
    assert cfg.rollout.max_staleness == 1 and cfg.rollout.lockstep
    assert cfg.rollout.device == "auto"


def test_rollout_async_takes_its_knobs():
    cfg = compose_config(["model=tiny", "rollout=async", "rollout.max_staleness=2", "rollout.threads=2"])
    assert cfg.rollout.mode == RolloutMode.ASYNC
    assert (cfg.rollout.max_staleness, cfg.rollout.threads) == (2, 2)


@pytest.mark.parametrize("key", ["rollout.lend_threads=true", "rollout.eval_on=worker"])
def test_the_cpu_only_async_knobs_are_gone_and_named_when_given(key):
    """rollout.lend_threads and rollout.eval_on were removed: a command line that still sets one fails
    naming it instead of being ignored."""
    with pytest.raises(Exception, match=re.escape(key.split("=")[0])):
        compose_config(["model=tiny", "rollout=async", key])


def test_async_weighs_stale_tokens_one_by_one_and_sync_keeps_the_sequence_default():
    """rollout=async sets the behaviour weight per token (AReaL's); rollout=sync keeps sequence_mask for a
    vLLM sampler's mismatch; an explicit choice wins under async."""
    assert (
        compose_config(["model=tiny", "rollout=async"]).grpo.rollout_correction
        == RolloutCorrection.TOKEN_MASK
    )
    assert compose_config(["model=tiny"]).grpo.rollout_correction == RolloutCorrection.SEQUENCE_MASK
    chosen = compose_config(["model=tiny", "rollout=async", "grpo.rollout_correction=token_tis"])
    assert chosen.grpo.rollout_correction == RolloutCorrection.TOKEN_TIS


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["rollout.max_staleness=-1"], r"rollout\.max_staleness=-1: must be >= 0"),
        (["rollout.threads=0"], r"rollout\.threads=0: must be >= 1"),
        (["rollout.timeout_s=0"], r"rollout\.timeout_s=0\.0: must be > 0"),
        (["rollout.device=gpu"], r"rollout\.device='gpu': must be auto, cpu or cuda:N"),
        (["rollout.device=cuda"], r"rollout\.device='cuda': must be auto, cpu or cuda:N"),
        (["rollout.device=cuda:one"], r"rollout\.device='cuda:one': must be auto, cpu or cuda:N"),
        (["rollout.device=cuda:-1"], r"rollout\.device='cuda:-1': must be auto, cpu or cuda:N"),
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
    assert compose_config(["model=tiny", "rollout.device=gpu"]).rollout.mode == RolloutMode.SYNC


def test_rollout_device_takes_cpu_and_the_gpus_torch_sees():
    for value in ["cpu", "auto", *(f"cuda:{i}" for i in range(torch.cuda.device_count()))]:
        assert (
            compose_config(["model=tiny", "rollout=async", f"rollout.device={value}"]).rollout.device == value
        )


def test_a_gpu_torch_does_not_see_is_named_with_the_count():
    count = torch.cuda.device_count()
    message = rf"rollout\.device='cuda:{count}': torch sees {count} GPU\(s\) here"
    with pytest.raises(ConfigError, match=message):
        compose_config(["model=tiny", "eval.every_steps=0", "rollout=async", f"rollout.device=cuda:{count}"])
