"""trainer.padding_free and trainer.micro_batch_tokens: their checks (ConfigError naming the key), what
null resolves to, and the start line that says it."""

import re

import pytest

from grpo_run.config.validation import ConfigError
from grpo_run.packing.settings import packing_line, packing_state, resolved
from tests.builders import compose_config


@pytest.mark.parametrize(
    "overrides,key",
    [
        (["trainer.micro_batch_tokens=0"], "trainer.micro_batch_tokens"),
        (
            ["trainer.padding_free=true", "distributed=zero2", "distributed.nproc_per_node=2"],
            "trainer.padding_free",
        ),
    ],
)
def test_bad_values_name_the_key(overrides, key):
    with pytest.raises(ConfigError, match=re.escape(key)):
        compose_config(overrides)


def test_good_values_pass():
    cfg = compose_config(["trainer.padding_free=true", "trainer.micro_batch_tokens=4096"])
    assert (cfg.trainer.padding_free, cfg.trainer.micro_batch_tokens) == (True, 4096)
    # null on several ranks is not an error: it resolves to off
    cfg = compose_config(["distributed=zero2", "distributed.nproc_per_node=2"])
    assert resolved(cfg) == (False, "auto: off on several ranks")


def test_null_packs_on_one_rank_with_the_native_forward_and_true_packs():
    assert resolved(compose_config([])) == (True, "auto: one rank, native forward")
    assert resolved(compose_config(["backend=plain"]))[0] is False
    assert resolved(compose_config(["grpo.top_entropy_quantile=0.2"]))[0] is False
    assert packing_state(compose_config(["trainer.padding_free=false"])) is None
    assert resolved(compose_config(["trainer.padding_free=true"]))[0] is True
    state = packing_state(compose_config(["trainer.padding_free=true", "trainer.micro_batch_tokens=2048"]))
    assert state is not None and state.budget == 2048 and state.enabled and not state.checked


def test_the_start_line_says_on_or_off_and_why():
    assert packing_line(compose_config(["trainer.padding_free=false"])) == (
        "padding_free: off (trainer.padding_free=false): micro-batches of trainer.micro_batch_size rows, padded"
    )
    assert packing_line(compose_config([])) == (
        "padding_free: on (auto: one rank, native forward): packed micro-batches of up to 16 x the longest "
        "row, checked on the first step"
    )
    assert packing_line(compose_config(["trainer.padding_free=true"])) == (
        "padding_free: on (trainer.padding_free=true): packed micro-batches of up to 16 x the longest "
        "row, checked on the first step"
    )


def test_the_plan_estimates_a_packed_micro_batch_by_its_token_budget():
    from grpo_run.plan.inputs import estimated_micro_batch

    # max_new_tokens 256 after a 120-token prompt: 376 tokens a row. 4096 tokens hold ceil(4096 / 376) = 11
    # full rows; 100 tokens, less than a row, still one (an over-budget sequence runs alone).
    args = ["generation.max_new_tokens=256", "trainer.micro_batch_size=16", "trainer.padding_free=true"]
    assert estimated_micro_batch(compose_config([*args, "trainer.micro_batch_tokens=4096"]), 120) == 11
    assert estimated_micro_batch(compose_config([*args, "trainer.micro_batch_tokens=100"]), 120) == 1
    # the default budget (16 x the longest row) and padded runs: micro_batch_size rows
    assert estimated_micro_batch(compose_config(args), 120) == 16
    padded = [*args, "trainer.micro_batch_tokens=4096", "trainer.padding_free=false"]  # the last wins
    assert estimated_micro_batch(compose_config(padded), 120) == 16
