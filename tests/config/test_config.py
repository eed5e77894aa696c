"""Every YAML in conf/ composes onto the schema and converts; bad values fail naming the key."""

import importlib.util
import re
from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf.errors import OmegaConfBaseException

from grpo_run.algo import AdvantageMode, Aggregation, StdCorrection
from grpo_run.cli import CONF_DIR
from grpo_run.config import Config, ConfigError, register_configs
from tests.builders import compose_config

register_configs()
GROUPS = sorted(p.name for p in Path(CONF_DIR).iterdir() if p.is_dir())


def test_groups_named_by_the_design_exist():
    for group in [
        "model",
        "reward",
        "data",
        "advantage_mode",
        "std_correction",
        "aggregation",
        "generation",
        "logger",
        "debug",
    ]:
        assert group in GROUPS


# Options whose required value has no sensible default.
NEEDS = {
    ("data", "jsonl"): ["data.train_path=train.jsonl", "data.eval_path=eval.jsonl"],
    ("data", "hub"): ["data.dataset=openai/gsm8k"],
    ("model", "pretrained"): ["model.path=org/x"],  # a hub id: plausible, never loaded here
    ("model", "local"): ["model.path=org/x"],
    ("kl_control", "adaptive"): ["grpo.beta=0.04"],  # adaptive scales beta: it must start > 0
    ("distill", "teacher"): ["distill.teacher.path=org/teacher"],
    ("reward", "reward_model"): ["reward.functions.0.model.path=org/reward-model"],
    ("reward", "judge"): ["reward.functions.0.model.path=org/judge-model"],
}


@pytest.mark.parametrize(
    "group,option",
    [(g, p.stem) for g in GROUPS for p in sorted((Path(CONF_DIR) / g).glob("*.yaml"))],
)
def test_every_option_composes_and_converts(group, option):
    overrides = [f"{group}={option}", *NEEDS.get((group, option), [])]
    if (group, option) == ("generation", "vllm") and importlib.util.find_spec("vllm") is None:
        # Without the package the run stops at validation, naming the extra to install.
        with pytest.raises(ConfigError, match=r"generation.engine='vllm'.*pip install -e '\.\[vllm\]'"):
            compose_config(overrides)
        return
    cfg = compose_config(overrides)
    assert isinstance(cfg, Config)


def test_defaults_are_typed():
    cfg = compose_config([])
    assert cfg.grpo.advantage_mode is AdvantageMode.NORMALIZED
    assert cfg.grpo.std_correction is StdCorrection.POPULATION
    assert cfg.grpo.aggregation is Aggregation.PER_RESPONSE


def test_group_choices_land_in_grpo():
    cfg = compose_config(["advantage_mode=centered", "std_correction=sample", "aggregation=per_token"])
    assert cfg.grpo.advantage_mode is AdvantageMode.CENTERED
    assert cfg.grpo.std_correction is StdCorrection.SAMPLE
    assert cfg.grpo.aggregation is Aggregation.PER_TOKEN


BAD_VALUES = [
    (["grpo.group_size=1"], "grpo.group_size"),
    (["grpo.epsilon=0"], "grpo.epsilon"),
    (["grpo.epsilon=1.5"], "grpo.epsilon"),
    (["grpo.beta=-0.1"], "grpo.beta"),
    (["grpo.num_iterations=0"], "grpo.num_iterations"),
    (
        ["trainer.micro_batch_size=3", "trainer.prompts_per_step=2", "grpo.group_size=4"],
        "trainer.micro_batch_size",
    ),
    (["trainer.lr=0"], "trainer.lr"),
    (["generation.temperature=0"], "generation.temperature"),
    (["distributed=zero2", "distributed.timeout_s=0"], "distributed.timeout_s"),
    # grpo.constant_length follows it by interpolation; the error names the key the user set.
    (["generation.max_new_tokens=0"], "generation.max_new_tokens"),
    (["generation.top_p=1.5"], "generation.top_p"),
    (["generation.min_p=-0.1"], "generation.min_p"),
    (["backend.release_free_memory_layers=-1"], "backend.release_free_memory_layers"),
    (["backend.logprob_chunk_size=0"], "backend.logprob_chunk_size"),
    (["model=pretrained"], "model.path"),
    (["model.path=/my/model"], "model.path"),  # the default model=smollm2-135m would ignore it
    (["model=tiny", "model.path=/my/model"], "model.path"),
    (["data=jsonl", "eval.every_steps=0"], "data.train_path"),
    (["data=jsonl", "data.train_path=t.jsonl", "eval.every_steps=5"], "data.eval_path"),
    (["+data.few_shot=[{role: user, content: hi}, {role: robot, content: x}]"], "data.few_shot[1].role"),
    (["alerts.empty_length=0"], "alerts.empty_length"),
    (["alerts.empty_steps=0"], "alerts.empty_steps"),
]


@pytest.mark.parametrize("overrides,key", BAD_VALUES)
def test_bad_values_name_the_key(overrides, key):
    with pytest.raises(ConfigError, match=re.escape(key)):
        compose_config(overrides)


# The loss variants: each knob's range, and combinations that make no sense name both keys.
BAD_VALUES += [
    (["grpo.top_entropy_quantile=0"], "grpo.top_entropy_quantile"),
    (["grpo.top_entropy_quantile=1.2"], "grpo.top_entropy_quantile"),
    (["grpo.off_policy_mask_threshold=-1"], "grpo.off_policy_mask_threshold"),
    (["grpo.cispo_cap=0"], "grpo.cispo_cap"),
    (["grpo.sapo_tau_neg=0"], "grpo.sapo_tau_neg"),
    (["grpo.policy_loss=dppo_tv", "grpo.trust_region_high=0"], "grpo.trust_region_high"),
    (["grpo.entropy_control=adaptive", "grpo.entropy_target=0"], "grpo.entropy_target"),
    (["grpo.entropy_control=adaptive", "grpo.entropy_coef=2"], "grpo.entropy_coef"),
    (["grpo.rollout_correction_min=3"], "grpo.rollout_correction_min"),  # must lie below the cap 3
    # On-policy distillation (distill=teacher | self).
    (["distill=teacher"], "distill.teacher.path"),
    (["distill=self", "distill.coef=0"], "distill.coef"),
    (["distill=self", "distill.discount=1.5"], "distill.discount"),
    (["distill=self", "distill.reward_weight=-1"], "distill.reward_weight"),
    (["distill=self", "distill.form=distribution", "distill.jsd_beta=1.5"], "distill.jsd_beta"),
    (["distill=self", "distill.form=distribution", "distill.jsd_beta=-0.1"], "distill.jsd_beta"),
    (["distill=self", "distill.teacher_context= "], "distill.teacher_context"),
    (["distill=teacher", "distill.teacher.path=t", "distill.teacher.device=gpu0"], "distill.teacher.device"),
]

NONSENSE = [
    (["grpo.policy_loss=sapo", "grpo.clip_ratio_c=3"], "grpo.clip_ratio_c", "grpo.policy_loss"),
    (["grpo.policy_loss=sapo", "grpo.epsilon_high=0.28"], "grpo.epsilon_high", "grpo.policy_loss"),
    (["grpo.policy_loss=cispo", "grpo.clip_ratio_c=3"], "grpo.clip_ratio_c", "grpo.policy_loss"),
    (["grpo.policy_loss=cispo", "grpo.epsilon_high=0.28"], "grpo.epsilon_high", "grpo.cispo_bounds"),
    (["grpo.policy_loss=cispo", "grpo.delta=2"], "grpo.delta", "grpo.policy_loss"),
    (["grpo.policy_loss=dppo_kl", "grpo.delta=2"], "grpo.delta", "grpo.policy_loss"),
    (["grpo.delta=2", "grpo.clip_ratio_c=3"], "grpo.delta", "grpo.clip_ratio_c"),
    (["grpo.policy_loss=clip", "grpo.trust_region_low=0.1"], "grpo.trust_region_low", "grpo.policy_loss"),
    (
        ["grpo.policy_loss=dppo_tv", "grpo.importance_level=sequence"],
        "grpo.importance_level",
        "grpo.policy_loss",
    ),
    (["grpo.kl_bias_correction=true"], "grpo.kl_bias_correction", "grpo.beta"),
    (
        ["reward.aggregation=normalize_then_sum", "advantage_mode=rloo"],
        "grpo.advantage_mode",
        "reward.aggregation",
    ),
    (
        ["grpo.rollout_correction=none", "grpo.rollout_correction_min=0.5"],
        "grpo.rollout_correction_min",
        "grpo.rollout_correction",
    ),
    (
        ["reward.aggregation=normalize_then_sum", "distributed=zero2", "distributed.nproc_per_node=2"],
        "reward.aggregation",
        "distributed.nproc_per_node",
    ),
    (
        ["distill=self", "grpo.off_policy_mask_threshold=0.5"],
        "grpo.off_policy_mask_threshold",
        "distill.form",
    ),
    (
        ["distill=self", "distill.form=distribution", "distill.discount=0.5"],
        "distill.discount",
        "distill.form",
    ),
    (
        ["distill=self", "distill.jsd_beta=0.5"],
        "distill.jsd_beta",
        "distill.form",
    ),  # only distribution reads it
    (["distill=self", "grpo.filter_zero_std=true"], "grpo.filter_zero_std", "distill.reward_weight"),
    (["distill=self", "distill.teacher.path=/models/t"], "distill.teacher.path", "distill.kind"),
]


@pytest.mark.parametrize("overrides,key,other", NONSENSE)
def test_nonsense_combinations_name_both_keys(overrides, key, other):
    with pytest.raises(ConfigError) as info:
        compose_config(overrides)
    assert str(info.value).startswith(key + "=") and f"{other}=" in str(info.value)


def test_delta_must_exceed_one_plus_epsilon_high():
    with pytest.raises(ConfigError, match=r"grpo\.delta=1\.2: must be > 1 \+ grpo\.epsilon_high"):
        compose_config(["grpo.delta=1.2"])
    with pytest.raises(ConfigError, match=r"grpo\.delta=1\.25"):
        compose_config(["grpo.delta=1.25", "grpo.epsilon_high=0.28"])
    assert compose_config(["grpo.delta=1.5", "grpo.epsilon_high=0.28"]).grpo.delta == 1.5


def test_recipes_set_their_policy_loss():
    assert compose_config(["experiment=cispo"]).grpo.policy_loss.value == "cispo"
    sapo = compose_config(["experiment=sapo"]).grpo
    assert (sapo.policy_loss.value, sapo.sapo_tau_pos, sapo.sapo_tau_neg) == ("sapo", 1.0, 1.05)


BAD_COMPOSITION = [
    (["grpo.gorup_size=4"], "gorup_size"),  # typo
    (["grpo.group_size=four"], "grpo.group_size"),  # wrong type
    (["model=nonexistent"], "model"),  # unknown option
    (["advantage_mode=whitened"], "advantage_mode"),
    (["grpo.advantage_mode=whitened"], "grpo.advantage_mode"),
    (["+trainer.bogus=1"], "bogus"),
]


@pytest.mark.parametrize("overrides,needle", BAD_COMPOSITION)
def test_bad_composition_names_the_key(overrides, needle):
    with pytest.raises((ConfigCompositionException, OmegaConfBaseException, ConfigError)) as info:
        compose_config(overrides)
    text = str(info.value) + str(info.value.__cause__ or "")
    assert needle in text
