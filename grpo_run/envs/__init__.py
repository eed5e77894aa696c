"""Multi-turn environments (docs/environments.md): the protocol the rollout calls, and the shipped ones."""

from grpo_run.envs.base import Environment, EnvResponse, Message

__all__ = ["EnvResponse", "Environment", "Message"]
