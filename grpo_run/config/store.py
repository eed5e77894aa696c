"""Register the schemas with Hydra's ConfigStore.

`conf/config.yaml` starts its defaults list with `grpo_run_schema`, so every group YAML is merged
onto a typed node: the per-group dataclasses in `schema.py` check keys and types while composing.
"""

from hydra.core.config_store import ConfigStore

from grpo_run.config.run_dir import register_resolver
from grpo_run.config.schema import Config


def register_configs() -> None:
    ConfigStore.instance().store(name="grpo_run_schema", node=Config)
    register_resolver()  # ${fresh_dir:...}, the default run and sweep directories
