"""`grpo-run`: Hydra composes the config, `to_config` types and validates it, `train` runs. No logic here."""

import os
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, open_dict
from omegaconf.errors import OmegaConfBaseException

from grpo_run import early_signal
from grpo_run.config import ConfigError, register_configs, to_config
from grpo_run.config.hydra_errors import job, run_app
from grpo_run.config.run_dir import give_up_claim
from grpo_run.engine.launch import adopt_launcher, needs_self_launch
from grpo_run.exit_codes import EXIT_CONFIG_ERROR
from grpo_run.launcher import die_with_launcher, self_launch
from grpo_run.safety.writable import exit_unless_writable
from grpo_run.tracking.secrets import redact_streams

register_configs()

# conf/ sits at the repository root beside grpo_run/ (an editable install keeps it there).
CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")


def _run_dir() -> str:
    return HydraConfig.get().runtime.output_dir


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
@job  # an exception from here on is the run's own failure (exit 1), not a config error
def app(cfg: DictConfig) -> float | None:
    with open_dict(cfg):
        cfg.run_dir = _run_dir()
        adopt_launcher(cfg.distributed)  # under torchrun/srun: the ranks they started
    try:
        config = to_config(cfg)
    except (ConfigError, OmegaConfBaseException) as err:  # values, interpolations, missing keys
        print(f"grpo-run: invalid config: {err}", file=sys.stderr)
        sys.exit(EXIT_CONFIG_ERROR)
    if needs_self_launch(config.distributed):
        # The ranks rerun this job's overrides in the one run dir validated and pinned here.
        hydra_cfg = HydraConfig.get()
        code = self_launch(
            config.distributed, list(hydra_cfg.overrides.task), config.run_dir, hydra_cfg.job.config_name
        )
        if code:
            sys.exit(code)
        if config.distributed.node_rank > 0:
            give_up_claim(config.run_dir)  # this node's ranks wrote to node 0's run dir, not to this one
        return None
    from grpo_run.entry import run  # heavy imports (torch, transformers) only after validation

    return run(config, cfg)


def main() -> None:
    early_signal.catch()  # a rank started as `python -m grpo_run.cli`: kept from here (grpo_run/console.py)
    die_with_launcher()  # a rank `grpo-run` started itself ends with it, even when it is SIGKILLed
    redact_streams()  # before anything prints: Hydra echoes a bad override's value, secret or not
    exit_unless_writable(sys.argv[1:])  # before Hydra's file log handler would fail without the cause
    # A `_target_` (your reward, environment) imports from PYTHONPATH or from where you launch grpo-run, as
    # `python -m` would: a console script has only its own folder on sys.path. Appended: it never shadows.
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    run_app(app, EXIT_CONFIG_ERROR)  # Hydra's own composition errors exit 2 too, with a "did you mean"


if __name__ == "__main__":
    main()
