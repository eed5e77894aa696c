"""The env group: single_turn by default, limits validated by name, names and targets resolved early."""

import json

import pytest

from grpo_run.config import ConfigError
from grpo_run.config.schema import Config, EnvConfig
from grpo_run.envs.calculator import Calculator
from grpo_run.envs.python_tool import PythonTool
from grpo_run.envs.registry import build_environment, check_environment
from grpo_run.safety.resume_policy import CONFIG_FILE, ResumeConfigError, check_resume, flat
from tests.builders import compose_config
from tests.envs.toy import AlwaysAnswers


def test_single_turn_is_the_default_and_builds_nothing():
    cfg = compose_config(["model=tiny"])
    assert cfg.env == EnvConfig() and cfg.env.name == "single_turn"
    assert build_environment(cfg.env) is None


def test_the_shipped_environments_build():
    assert isinstance(build_environment(compose_config(["model=tiny", "env=calculator"]).env), Calculator)
    tool = build_environment(compose_config(["model=tiny", "env=python_tool", "env.tool_timeout_s=2.5"]).env)
    assert isinstance(tool, PythonTool) and tool.limits.wall_s == 2.5 and tool.limits.cpu_s == 3


def test_a_user_environment_plugs_in_by_target():
    env = EnvConfig(name="mine", _target_="tests.envs.toy.AlwaysAnswers", kwargs={"observation": "hi"})
    check_environment(env)
    built = build_environment(env)
    assert isinstance(built, AlwaysAnswers) and built.observation == "hi"


@pytest.mark.parametrize(
    "override,key",
    [
        ("env.max_turns=0", "env.max_turns=0"),
        ("env.max_total_tokens=0", "env.max_total_tokens=0"),
        ("env.tool_timeout_s=0", "env.tool_timeout_s=0"),
        ("env.max_observation_chars=0", "env.max_observation_chars=0"),
    ],
)
def test_bad_limits_name_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        compose_config(["model=tiny", "env=calculator", override])


def test_a_vllm_engine_fits_an_episodes_whole_history():
    """max_model_len: the longest prompt + env.max_total_tokens when that is longer than one completion
    (here 5 prompt tokens + 300 > 5 + 64)."""
    from grpo_run.models.tiny import build_tokenizer
    from grpo_run.rollout.vllm_engine import derived_max_model_len

    tok = build_tokenizer()
    prompt = "abcde"
    n = len(tok(prompt, add_special_tokens=False).input_ids)
    single = compose_config(["model=tiny", "generation.max_new_tokens=64", "eval.max_new_tokens=16"])
    multi = compose_config(
        ["model=tiny", "generation.max_new_tokens=64", "eval.max_new_tokens=16", "env=calculator"]
        + ["env.max_total_tokens=300"]
    )
    assert derived_max_model_len(single, tok, [prompt]) == n + 64
    assert derived_max_model_len(multi, tok, [prompt]) == n + 300


def test_unknown_names_and_targets_are_config_errors():
    with pytest.raises(ConfigError, match=r"env\.name='calculater'.*calculator"):
        check_environment(EnvConfig(name="calculater"))
    with pytest.raises(ConfigError, match=r"env\._target_='no_such_module\.Env'"):
        check_environment(EnvConfig(name="x", _target_="no_such_module.Env"))


def test_a_checkpoint_from_before_the_env_group_resumes_at_single_turn(tmp_path):
    cfg = Config()
    saved = {k: v for k, v in flat(cfg).items() if not k.startswith("env.")}
    (tmp_path / CONFIG_FILE).write_text(json.dumps(saved))
    assert check_resume(cfg, tmp_path) == []
    with pytest.raises(ResumeConfigError, match=r"env\.name='calculator'"):
        check_resume(Config(env=EnvConfig(name="calculator")), tmp_path)
