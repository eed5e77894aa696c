"""Config checks, one module per section (or group of sections), each beside the keys it checks.

`grpo_run.config.validation.validate` calls them in the order their first error is reported; a check
raises `ConfigError` naming the full key and the value (`base.fail`).
"""
