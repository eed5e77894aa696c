"""Hydra's own composition errors are config errors too: exit 2 with a "did you mean", like `to_config`'s.

Hydra reports an unknown key (`grpo.betta=0.1`), an unknown group option (`model=tinny`) or a bad
override (`grpo.beta=[`) itself and exits 1, the code of a failed run. `run_app` lets those exceptions
reach us instead (Hydra's `HYDRA_FULL_ERROR` path) and tells them apart from an exception raised inside
a job, which `job` marks: that one is the run's own failure and keeps exit code 1.
"""

import dataclasses
import difflib
import functools
import os
import sys
import traceback
from collections.abc import Callable, Iterable
from typing import Any

from hydra.errors import CompactHydraException, MissingConfigException
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

from grpo_run.config.removed import removed_hint
from grpo_run.config.trl_names import trl_hint
from grpo_run.exit_codes import EXIT_FAILED


class _JobState:
    raised = False  # an exception left a job's own function (the run failed, the config did not)


def job(task: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap the Hydra task function so an exception from the job itself stays a failed run."""

    @functools.wraps(task)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return task(*args, **kwargs)
        except Exception:
            _JobState.raised = True
            raise

    return wrapper


def close_matches(word: str, candidates: Iterable[str]) -> list[str]:
    return difflib.get_close_matches(word, sorted(set(candidates)), n=3, cutoff=0.6)


def did_you_mean_key(full_key: str, known: Iterable[str]) -> str:
    """'Did you mean grpo.beta?' for 'grpo.betta' among `known` (its parent's keys), or ''."""
    parent, _, leaf = full_key.rpartition(".")
    matches = close_matches(leaf, known)
    prefix = f"{parent}." if parent else ""
    return f"Did you mean {' or '.join(prefix + m for m in matches)}?" if matches else ""


def _suggestion(err: BaseException) -> str:
    if isinstance(err, MissingConfigException) and err.missing_cfg_file and err.options:
        group, _, option = err.missing_cfg_file.rpartition("/")
        matches = close_matches(option, err.options)
        return f"Did you mean {' or '.join(f'{group}={m}' for m in matches)}?" if matches else ""
    cause = err.__cause__
    # A removed key or value an old config names (`distill.kl_estimator`, `distill.form=loss`): its successor.
    if isinstance(cause, OmegaConfBaseException) and cause.full_key:
        hint = removed_hint(cause.full_key, cause.value)
        if hint:
            return hint
    if isinstance(cause, (ConfigAttributeError, ConfigKeyError)) and cause.full_key:
        # A TRL GRPOConfig name (`learning_rate`, `grpo.num_generations`) is no typo: say what it is here.
        hint = trl_hint(cause.full_key)
        if hint:
            return hint
        # The node that lacks the key is typed (our schema, Hydra's own): its fields are the candidates.
        schema = cause.object_type
        if schema is not None and dataclasses.is_dataclass(schema):
            return did_you_mean_key(cause.full_key, (f.name for f in dataclasses.fields(schema)))
    return ""


def describe(err: BaseException) -> str:
    """Hydra's own text for a composition error, its OmegaConf cause, and a suggestion where one is close."""
    # Hydra's "To append to your config use +key=..." does not hold here: the typed schema refuses it too.
    lines = [line for line in str(err).splitlines() if not line.startswith("To append to your config")]
    if isinstance(err.__cause__, OmegaConfBaseException):
        lines.append(str(err.__cause__))
    suggestion = _suggestion(err)
    if suggestion:
        lines.append(suggestion)
    return "\n".join(lines)


def is_config_error(err: BaseException) -> bool:
    return not _JobState.raised and isinstance(err, (CompactHydraException, OmegaConfBaseException))


def run_app(app: Callable[[], Any], exit_config_error: int) -> None:
    """Run a `@hydra.main` app; a composition error exits `exit_config_error`, a job's own error 1."""
    wants_trace = bool(os.environ.get("HYDRA_FULL_ERROR"))
    os.environ["HYDRA_FULL_ERROR"] = "1"  # Hydra re-raises instead of printing and exiting 1 itself
    try:
        app()
    except BrokenPipeError:  # `grpo-run --help | head`: the reader has gone; no traceback for that
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(EXIT_FAILED)
    except Exception as err:
        if wants_trace:
            traceback.print_exc()
        if is_config_error(err):
            print(f"grpo-run: invalid config: {describe(err)}", file=sys.stderr)
            sys.exit(exit_config_error)
        if not wants_trace:
            traceback.print_exc()
        sys.exit(EXIT_FAILED)
