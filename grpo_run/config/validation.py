"""Checks on values that types alone cannot express. Every error names the full key and the value.

Each section's checks live beside it in `grpo_run/config/checks/`; `validate` is their table of
contents, in the order the first error is reported. The names below are re-exported from here, where
the rest of the code imports them.
"""

from grpo_run.config.checks import (
    backend,
    data,
    distill,
    distributed,
    env,
    evaluation,
    generation,
    grpo,
    lora,
    model,
    reliability,
    reward,
    rollout,
    trainer,
)
from grpo_run.config.checks.base import ConfigError
from grpo_run.config.checks.data import CHAT_ROLES, validate_data_fields
from grpo_run.config.checks.distributed import validate_distributed
from grpo_run.config.checks.env import validate_env
from grpo_run.config.checks.evaluation import validate_eval_datasets
from grpo_run.config.checks.generation import validate_vllm
from grpo_run.config.checks.grpo import validate_loss_knobs, validate_policy_loss, validate_variants
from grpo_run.config.checks.lora import validate_lora
from grpo_run.config.checks.model import autocast_setting
from grpo_run.config.checks.reliability import validate_plan_and_alerts, validate_reliability
from grpo_run.config.checks.reward import validate_code_exec, validate_overlong_penalty
from grpo_run.config.checks.rollout import (
    ROLLOUT_DEVICE,
    rollout_gpu_index,
    validate_rollout,
    validate_rollout_gpu,
)
from grpo_run.config.checks.trainer import validate_cuda
from grpo_run.config.schema import Config

__all__ = [
    "CHAT_ROLES",
    "ROLLOUT_DEVICE",
    "ConfigError",
    "autocast_setting",
    "rollout_gpu_index",
    "validate",
    "validate_code_exec",
    "validate_cuda",
    "validate_data_fields",
    "validate_distributed",
    "validate_env",
    "validate_eval_datasets",
    "validate_lora",
    "validate_loss_knobs",
    "validate_overlong_penalty",
    "validate_plan_and_alerts",
    "validate_policy_loss",
    "validate_reliability",
    "validate_rollout",
    "validate_rollout_gpu",
    "validate_variants",
    "validate_vllm",
]


def validate(cfg: Config) -> None:
    grpo.validate_grpo(cfg)
    # Before the variants: grpo.constant_length defaults to this value, and the key the user set is this one.
    generation.validate_max_new_tokens(cfg)
    grpo.validate_variants(cfg)
    reward.validate_reward_options(cfg)
    trainer.validate_batch(cfg)
    trainer.validate_packing(cfg)
    distributed.validate_distributed(cfg)
    reliability.validate_reliability(cfg)
    reliability.validate_plan_and_alerts(cfg)
    lora.validate_lora(cfg)
    env.validate_env(cfg)
    rollout.validate_rollout(cfg)
    distill.validate_distill(cfg)
    trainer.validate_optimizer(cfg)
    backend.validate_backend(cfg)
    trainer.validate_device(cfg)
    generation.validate_sampling(cfg)
    grpo.validate_sampler_correction(cfg)
    generation.validate_engine(cfg)
    reward.validate_rewards(cfg)
    model.validate_model(cfg)
    data.validate_data(cfg)
    evaluation.validate_eval(cfg)
