"""The policy-loss table (grpo_run/algo/losses.py, POLICY_LOSSES) describes each variant fully: its
surrogate, the grpo keys it alone reads, their checks and its metrics; these tests walk the table, so a
new variant is covered by adding its entry."""

import copy
import dataclasses
import re

import pytest
import torch

from grpo_run.algo import POLICY_LOSSES, LossInputs, LossSettings, PolicyLoss, PolicyLossOutput, policy_loss
from grpo_run.config import ConfigError
from grpo_run.config.schema import GrpoConfig
from grpo_run.config.validation import validate
from tests.builders import compose_config

GRPO_KEYS = {f.name for f in dataclasses.fields(GrpoConfig)}
SETTINGS = {f.name for f in dataclasses.fields(LossSettings)}
# A value each exclusive knob may take under a variant that reads it (the table's checks accept it).
ALLOWED = {"delta": 2.0, "trust_region_low": 0.1, "trust_region_high": 0.1}


@pytest.fixture(scope="module")
def base():
    return compose_config(["eval.every_steps=0"])


def test_every_policy_loss_has_an_entry_in_the_table():
    assert set(POLICY_LOSSES) == set(PolicyLoss)
    assert all(callable(v.surrogate) and callable(v.check) for v in POLICY_LOSSES.values())


def test_every_knob_is_one_grpo_key_copied_into_the_settings():
    # LossSettings.from_knobs copies each field from the grpo key of the same name.
    assert SETTINGS <= GRPO_KEYS
    for variant in POLICY_LOSSES.values():
        assert set(variant.knobs) <= SETTINGS
        assert set(variant.exclusive) <= set(variant.knobs)
        assert set(variant.metrics) <= set(PolicyLossOutput._fields)
        assert set(variant.exclusive) <= set(ALLOWED)


def test_settings_take_the_grpo_keys_and_fill_the_nulls():
    # epsilon_high null -> epsilon 0.1; the trust region null -> [epsilon, epsilon_high] = [0.1, 0.1]
    s = LossSettings.from_knobs(vars(GrpoConfig(epsilon=0.1, policy_loss=PolicyLoss.DPPO_TV)))
    assert (s.epsilon_high, s.trust_region_low, s.trust_region_high) == (0.1, 0.1, 0.1)
    s = LossSettings.from_knobs(vars(GrpoConfig(epsilon_high=0.28, trust_region_low=0.05, cispo_cap=2.0)))
    assert (s.epsilon_high, s.trust_region_low, s.trust_region_high, s.cispo_cap) == (0.28, 0.05, 0.28, 2.0)


def owner_and_others():
    for name, variant in POLICY_LOSSES.items():
        for key in variant.exclusive:
            for other, reader in POLICY_LOSSES.items():
                if key not in reader.knobs:
                    yield pytest.param(name, key, other, id=f"{key}-{name.value}-under-{other.value}")


@pytest.mark.parametrize(("owner", "key", "other"), list(owner_and_others()))
def test_a_variants_knob_is_refused_under_another_naming_both_keys(base, owner, key, other):
    def run(loss):
        cfg = copy.deepcopy(base)
        cfg.grpo = dataclasses.replace(cfg.grpo, policy_loss=loss, **{key: ALLOWED[key]})
        validate(cfg)

    run(owner)  # its own variant accepts it
    why = re.escape(f"grpo.{key}={ALLOWED[key]!r}: cannot be combined with grpo.policy_loss='{other.value}'")
    with pytest.raises(ConfigError, match=why):
        run(other)


VARIANT_METRICS = {m for variant in POLICY_LOSSES.values() for m in variant.metrics}


@pytest.mark.parametrize("name", list(PolicyLoss))
def test_each_variant_reports_its_own_metrics(name):
    # p_old -> p: 0.1 -> 0.9 and 0.2 -> 0.8 with A = +1 leave every clip and trust region (0.2), 0.3 -> 0.3
    # stays: dppo masks 2 of 3 tokens, and its trust_region_masked_fraction is that share, 2 / 3.
    lp = torch.log(torch.tensor([[0.9, 0.8, 0.3]], dtype=torch.float64))
    old = torch.log(torch.tensor([[0.1, 0.2, 0.3]], dtype=torch.float64))
    x = LossInputs(lp, old, torch.ones(1), torch.ones(1, 3))
    out = policy_loss(x, LossSettings(policy_loss=name), beta=0.0)
    claimed = POLICY_LOSSES[name].metrics
    for field in VARIANT_METRICS:
        if field in claimed:
            assert isinstance(getattr(out, field), torch.Tensor)
        else:  # a metric the variant does not claim keeps its default
            assert getattr(out, field) == PolicyLossOutput._field_defaults[field]
    if "trust_region_masked_fraction" in claimed:
        assert out.trust_region_masked_fraction.item() == pytest.approx(2 / 3)
