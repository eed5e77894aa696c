"""The only place that knows how gradients are reduced and applied (single process or DeepSpeed)."""

from grpo_run.engine.base import Engine
from grpo_run.engine.single import SingleProcessEngine

__all__ = ["Engine", "SingleProcessEngine"]
