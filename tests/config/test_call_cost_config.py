"""env.call_cost, env.cost_form and env.reward_levels at the door: refused costs name the key and the
numbers (at config time with explicit levels, when the run is built with derived ones), and a refused
cost exits 2 through the CLI before anything loads."""

import pytest

from grpo_run.config import ConfigError
from grpo_run.rewards.call_cost import CostForm
from grpo_run.scoring.levels import check_call_cost_levels, reward_levels
from tests.builders import compose_config
from tests.helpers import FAST, run_cli

CALC = ["model=tiny", "env=calculator"]


def test_off_by_default_and_accepted_within_the_margin():
    cfg = compose_config(CALC)
    assert cfg.env.call_cost == 0.0 and cfg.env.cost_form == CostForm.MULTIPLICATIVE
    assert cfg.env.reward_levels is None
    cfg = compose_config([*CALC, "env.call_cost=0.2", "env.cost_form=additive", "env.reward_levels=[0,1]"])
    assert cfg.env.cost_form == CostForm.ADDITIVE and cfg.env.reward_levels == [0, 1]


@pytest.mark.parametrize(
    "overrides,match",
    [
        (["env.call_cost=-0.1"], r"env\.call_cost=-0\.1: must be a finite number >= 0"),
        (["env.call_cost=1.0"], r"env\.call_cost=1\.0: must be < 1 with env\.cost_form=multiplicative"),
        (
            ["env.call_cost=0.25", "env.cost_form=additive", "env.reward_levels=[0,1]"],
            r"env\.call_cost=0\.25: additive: cost x env\.max_turns = 0\.25 x 4 = 1 reaches .*margin 1",
        ),
        (
            ["env.call_cost=0.5", "env.reward_levels=[0.1,1]"],
            r"env\.call_cost=0\.5: multiplicative: \(1 - 0\.5\)\*\*4 x correct_min 1 = 0\.0625",
        ),
        (["env.call_cost=0.1", "env.reward_levels=[1,0]"], r"env\.reward_levels=\[1\.0, 0\.0\]: must be"),
        (
            ["env.call_cost=0.1", "reward.aggregation=normalize_then_sum"],
            r"env\.call_cost=0\.1: cannot be combined with reward\.aggregation='normalize_then_sum'",
        ),
    ],
)
def test_refused_costs_name_the_key_and_the_numbers(overrides, match):
    with pytest.raises(ConfigError, match=match):
        compose_config([*CALC, *overrides])


def test_a_cost_needs_a_tool():
    with pytest.raises(ConfigError, match=r"env\.call_cost=0\.1: needs a tool: env=single_turn"):
        compose_config(["model=tiny", "env.call_cost=0.1"])


def test_levels_derived_from_the_reward_functions():
    assert reward_levels(compose_config([*CALC, "reward=math_verifier"])) == (0.0, 1.0)
    assert reward_levels(compose_config([*CALC, "reward=math_and_format"])) == (0.1, 1.0)
    # code_exec with fraction gives partial credit: not a gold check, so no levels
    assert reward_levels(compose_config([*CALC, "reward=code_exec"])) == (0.0, 1.0)
    assert (
        reward_levels(compose_config([*CALC, "reward=code_exec", "reward.functions.0.kwargs.fraction=true"]))
        is None
    )
    check_call_cost_levels(compose_config([*CALC, "reward=math_and_format", "env.call_cost=0.4"]))


def test_derived_levels_refuse_a_cost_past_the_margin_or_a_reward_without_levels():
    cfg = compose_config([*CALC, "reward=math_and_format", "env.call_cost=0.5"])  # 0.5**4 = 0.0625 <= 0.1
    with pytest.raises(ConfigError, match=r"env\.call_cost=0\.5: .* = \[0\.1, 1\.0\] from reward\.functions"):
        check_call_cost_levels(cfg)
    cfg = compose_config([*CALC, "reward=format", "env.call_cost=0.1"])
    with pytest.raises(ConfigError, match=r"env\.reward_levels=None: .*set env\.reward_levels"):
        check_call_cost_levels(cfg)
    # explicit levels replace the derivation
    check_call_cost_levels(
        compose_config([*CALC, "reward=format", "env.call_cost=0.1", "env.reward_levels=[0,1]"])
    )


@pytest.mark.parametrize(
    "overrides,match",
    [
        (["env.call_cost=0.3", "env.cost_form=additive", "env.reward_levels=[0,1]"], "env.call_cost=0.3"),
        (["reward=math_and_format", "env.call_cost=0.5"], "env.call_cost=0.5"),  # derived levels
        (["reward=format", "env.call_cost=0.1"], "env.reward_levels=None"),
    ],
)
def test_a_refused_cost_exits_2_before_anything_runs(tmp_path, overrides, match):
    fast = [a for a in FAST if not a.startswith("reward=")]
    reward = [] if any(a.startswith("reward=") for a in overrides) else ["reward=math_verifier"]
    proc, run_dir = run_cli([*fast, *reward, "env=calculator", *overrides], tmp_path, check=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert match in proc.stdout + proc.stderr
    assert not (run_dir / "metrics.jsonl").exists()
