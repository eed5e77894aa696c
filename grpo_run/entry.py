"""What `grpo-run` does once the config is valid: write the resolved config, train, report."""

import sys
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from grpo_run import metrics as M
from grpo_run.config.schema import Config
from grpo_run.data import DataError
from grpo_run.models.loading import ModelLoadError
from grpo_run.tracking import console

EXIT_FAILED = 1
EXIT_INTERRUPTED = 130


def run(config: Config, raw: DictConfig) -> float | None:
    from grpo_run.trainer import train

    run_dir = Path(config.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config_resolved.yaml").write_text(OmegaConf.to_yaml(raw, resolve=True))
    console.print(f"[bold]grpo-run[/] run dir: {run_dir.resolve()}")
    try:
        last = train(config)
    except KeyboardInterrupt:
        console.print(f"[yellow]interrupted; finished steps are in {run_dir / 'metrics.jsonl'}")
        sys.exit(EXIT_INTERRUPTED)
    except (DataError, ModelLoadError) as err:
        console.print(f"[red]grpo-run: {err}")
        sys.exit(EXIT_FAILED)
    console.print(f"[bold]done[/] run dir: {run_dir.resolve()}")
    return last.get(M.REWARD_MEAN)
