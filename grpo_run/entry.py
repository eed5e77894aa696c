"""What `grpo-run` does once the config is valid: write the resolved config, train, report."""

import os
import sys
from pathlib import Path
from typing import NoReturn

from omegaconf import DictConfig, OmegaConf

from grpo_run import early_signal
from grpo_run import metrics as M
from grpo_run.config import ConfigError
from grpo_run.config.schema import Config, DistributedKind, Mode
from grpo_run.data import DataError
from grpo_run.engine.deepspeed_import import keep_deepspeed_unimported
from grpo_run.engine.launch import is_main_process
from grpo_run.exit_codes import (
    EXIT_CONFIG_ERROR,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_LOST_CONTACT,
    EXIT_PREEMPTED,
)
from grpo_run.launcher import lost_contact
from grpo_run.models.loading import ModelLoadError
from grpo_run.safety.resume_policy import AlreadyTrained, ResumeConfigError
from grpo_run.safety.run_lock import RunDirBusy, hold_run_dir
from grpo_run.tracking import console
from grpo_run.tracking.secrets import redact, redact_run
from grpo_run.tracking.wandb_run import WandbUnreachable, with_hydra_identity


def hydra_output_subdir() -> str | None:
    """Where Hydra wrote its config.yaml / overrides.yaml in the run dir (`.hydra`), when it ran."""
    from hydra.core.hydra_config import HydraConfig

    return HydraConfig.get().output_subdir if HydraConfig.initialized() else None


def run(config: Config, raw: DictConfig) -> float | None:
    """Plans, trains or evaluates (config.mode); a known failure exits with its code and one line."""
    from grpo_run import backend

    backend.prepare_process(config.backend)  # before the first tensor: allocator settings apply from it on
    from grpo_run.checkpoint import CheckpointError
    from grpo_run.eval_mode import evaluate_only
    from grpo_run.rollout.source import RolloutSourceError
    from grpo_run.rollout.vllm_engine import VLLMUnavailable
    from grpo_run.safety.accounting import SampleAccountingError
    from grpo_run.safety.signals import Preempted
    from grpo_run.scoring.pool import RewardPoolError
    from grpo_run.trainer import NonFiniteError, RewardsFailed, ScoringFailed, train

    if config.distributed.kind == DistributedKind.SINGLE:
        keep_deepspeed_unimported()
    run_dir = Path(config.run_dir)
    if is_main_process():  # ranks > 0 of a distributed run write nothing
        _open_run_dir(run_dir, raw)
    config = with_hydra_identity(config)  # W&B group/name/tags of this (multirun) job
    if config.mode != Mode.TRAIN:  # no SignalCatcher takes over: a stop kept so far acts as by default
        early_signal.release()
    try:
        if config.mode == Mode.PLAN:
            return _plan(config)
        last = train(config) if config.mode == Mode.TRAIN else evaluate_only(config)
    except AlreadyTrained as err:  # a finished run resumed: nothing trained, nothing written, exit 0
        if is_main_process():
            console.print(f"grpo-run: {err}", soft_wrap=True, markup=False, highlight=False)
        return None
    except ResumeConfigError as err:  # NothingToTrain too: trainer.max_steps below the checkpoint's step
        _fail(f"grpo-run: invalid config: {err}", EXIT_CONFIG_ERROR)
    except KeyboardInterrupt:
        console.print(f"[yellow]interrupted; finished steps are in {run_dir / 'metrics.jsonl'}")
        sys.exit(EXIT_INTERRUPTED)
    except VLLMUnavailable as err:  # a configuration problem (generation=vllm on this model/machine)
        console.print(f"[red]grpo-run: {err}")
        sys.exit(EXIT_CONFIG_ERROR)
    except ConfigError as err:
        console.print(f"[red]grpo-run: invalid config: {err}", soft_wrap=True)
        sys.exit(EXIT_CONFIG_ERROR)
    except Preempted as err:
        if is_main_process():  # every rank stops at the same step; one line says so
            console.print(f"[yellow]grpo-run: {err}; resume with hydra.run.dir={run_dir} resume=auto")
        sys.exit(EXIT_PREEMPTED)
    except (
        DataError,
        ModelLoadError,
        CheckpointError,
        NonFiniteError,
        RewardPoolError,
        RewardsFailed,
        RolloutSourceError,
        SampleAccountingError,
        ScoringFailed,
        WandbUnreachable,
    ) as err:
        # One unwrapped line: the last line of the log names the path and the cause whole.
        _fail(f"grpo-run: {err}", EXIT_FAILED)
    except OSError as err:  # a disk full, a read-only or vanished file: the path and the cause, one line
        _fail(f"grpo-run: {err.filename or run_dir}: {err.strerror or err}", EXIT_FAILED)
    except RuntimeError as err:  # last: the errors above that are RuntimeErrors keep their own handling
        if config.distributed.kind != DistributedKind.DEEPSPEED or not lost_contact(err):
            raise
        _exit_lost_contact(config, err)
    if is_main_process():
        console.print(f"[bold]done[/] run dir: {run_dir.resolve()}")
    # What a sweeper (hydra-optuna-sweeper) maximises: held-out accuracy when evaluated (eval.reward's mean
    # on a set without gold answers), else the reward.
    return last.get(M.EVAL_ACCURACY, last.get(M.EVAL_REWARD_MEAN, last.get(M.REWARD_MEAN)))


def _open_run_dir(run_dir: Path, raw: DictConfig) -> None:
    """Makes and locks the run dir (exit 1 when another run holds it), then writes its resolved config
    with the secrets redacted (and redacts Hydra's own copies)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    try:
        hold_run_dir(run_dir)  # before anything in the dir is written or removed
    except RunDirBusy as err:
        _fail(f"grpo-run: {err}", EXIT_FAILED)
    redact_run(run_dir, hydra_output_subdir())
    (run_dir / "config_resolved.yaml").write_text(redact(OmegaConf.to_yaml(raw, resolve=True)))
    console.print(f"[bold]grpo-run[/] run dir: {run_dir.resolve()}")


def _plan(config: Config) -> None:
    """mode=plan: nothing trained; returns when the plan fits, else exits with the plan's code
    (EXIT_DOES_NOT_FIT, 3)."""
    from grpo_run.plan import plan

    code = plan(config)
    if code:
        sys.exit(code)


def _fail(line: str, code: int) -> NoReturn:
    """Prints `line` as is (red, unwrapped, no markup: paths and messages may hold brackets) and exits."""
    console.print(line, style="red", soft_wrap=True, markup=False, highlight=False)
    sys.exit(code)


def _exit_lost_contact(config: Config, err: RuntimeError) -> NoReturn:
    """A DeepSpeed rank that waited past distributed.timeout_s for another rank: exit EXIT_LOST_CONTACT. The
    launcher names the rank that stopped answering; this rank says what it waited for."""
    rank = os.environ.get("RANK", "?")
    _fail(
        f"grpo-run: rank {rank} got no answer from another rank (distributed.timeout_s="
        f"{config.distributed.timeout_s:g}): {err}",
        EXIT_LOST_CONTACT,
    )
