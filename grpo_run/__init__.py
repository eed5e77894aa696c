"""grpo-run: a Hydra-configured runner for GRPO fine-tuning."""

__version__ = "0.1.0"
