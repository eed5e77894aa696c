"""TRL's GRPOConfig names: the table points at keys that exist, the docs list it, and a TRL name given as
an override is answered with our key (through Hydra's refusal and through the door's, for `+key=`)."""

import re

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from grpo_run.cli import CONF_DIR
from grpo_run.config import ConfigError
from grpo_run.config.hydra_errors import describe
from grpo_run.config.trl_names import TRL_NAMES, NotOffered, Ours, trl_hint
from tests.builders import compose_config
from tests.helpers import REPO

_ABSENT = object()


def test_every_key_the_table_names_exists_in_the_composed_config():
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose(config_name="config", return_hydra_config=True)  # hydra.run.dir too
    keys = {entry.key for entry in TRL_NAMES.values() if isinstance(entry, Ours)}
    # reward.functions[i]: the default reward's first entry stands for every entry.
    missing = [k for k in keys if OmegaConf.select(cfg, k.replace("[i]", ".0"), default=_ABSENT) is _ABSENT]
    assert not missing, missing


def test_the_table_covers_what_a_grpo_user_sets():
    brief = """num_generations learning_rate per_device_train_batch_size gradient_accumulation_steps
    max_prompt_length max_completion_length beta epsilon epsilon_high delta loss_type scale_rewards
    mask_truncated_completions num_iterations temperature top_p top_k min_p repetition_penalty use_vllm
    vllm_mode vllm_gpu_memory_utilization importance_sampling_level reward_weights sync_ref_model
    disable_dropout top_entropy_quantile num_train_epochs max_steps warmup_ratio lr_scheduler_type
    weight_decay max_grad_norm seed bf16 gradient_checkpointing logging_steps save_steps output_dir report_to
    log_completions generation_batch_size steps_per_generation vllm_importance_sampling_correction"""
    assert set(brief.split()) <= set(TRL_NAMES)
    assert all(e.reason for e in TRL_NAMES.values() if isinstance(e, NotOffered))  # one honest reason each


def _docs_rows() -> dict[str, list[str]]:
    text = (REPO / "docs" / "configuration.md").read_text()
    section = text.split("## Coming from TRL's GRPOConfig", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        name = re.fullmatch(r"`(\w+)`", cells[0])
        if name:
            rows[name.group(1)] = cells[1:]
    return rows


def test_the_docs_table_lists_every_entry_and_no_other():
    rows = _docs_rows()
    assert set(rows) == set(TRL_NAMES)
    for name, entry in TRL_NAMES.items():
        ours = rows[name][0]
        if isinstance(entry, Ours):
            assert ours == f"`{entry.key}`", (name, ours)
        else:
            assert ours == "not offered", (name, ours)


def _hydra_refusal(override: str) -> str:
    """What `grpo-run OVERRIDE` prints after "invalid config:" when Hydra refuses the override."""
    with pytest.raises(ConfigCompositionException) as refused:
        compose_config([override])
    return describe(refused.value)


@pytest.mark.parametrize(
    "override,said",
    [
        ("num_generations=8", "num_generations is TRL's GRPOConfig name; did you mean grpo.group_size?"),
        (
            "trainer.learning_rate=1e-5",
            "trainer.learning_rate is TRL's GRPOConfig name; did you mean trainer.lr?",
        ),
        (
            "grpo.num_generations=8",
            "grpo.num_generations is TRL's GRPOConfig name; did you mean grpo.group_size?",
        ),
        ("grpo.loss_type=dapo", "grpo.loss_type is TRL's GRPOConfig name; did you mean grpo.aggregation?"),
        ("trainer.beta=0.04", "trainer.beta is TRL's GRPOConfig name; did you mean grpo.beta?"),  # misplaced
    ],
)
def test_a_trl_name_refused_by_hydra_gets_our_key(override, said):
    text = _hydra_refusal(override)
    assert said in text, text
    assert "Did you mean" not in text  # no difflib guess beside it (grpo.num_iterations for num_generations)


def test_the_loss_type_hint_says_which_aggregation_each_value_is():
    text = _hydra_refusal("grpo.loss_type=dapo")
    assert "dapo is aggregation=per_token" in text and "dr_grpo is constant_length" in text


def test_a_trl_name_added_with_plus_is_refused_at_the_door_with_our_key():
    with pytest.raises(ConfigError, match=r"did you mean grpo\.group_size\?"):
        compose_config(["+num_generations=8"])
    with pytest.raises(
        ConfigError, match=r"grpo\.loss_type is TRL's GRPOConfig name; did you mean grpo\.aggregation"
    ):
        compose_config(["+grpo.loss_type=dapo"])


def test_a_name_grpo_run_does_not_offer_says_why():
    assert trl_hint("grpo.sync_ref_model") == (
        "grpo.sync_ref_model is TRL's GRPOConfig name; grpo-run does not offer it: "
        + TRL_NAMES["sync_ref_model"].reason
    )
    text = _hydra_refusal("repetition_penalty=1.1")
    assert "repetition_penalty is TRL's GRPOConfig name; grpo-run does not offer it" in text


def test_other_unknown_keys_keep_the_close_match():
    assert trl_hint("grpo.betta") == ""
    assert "Did you mean grpo.beta" in _hydra_refusal("grpo.betta=0.1")
    with pytest.raises(ConfigError, match=r"did you mean grpo\.beta"):
        compose_config(["+grpo.betta=0.1"])
