"""Weights & Biases: a tracking sink (every metric each step on a `step` axis, completions tables) and
the run's identity in W&B (group, name, tags) taken from Hydra's record of the job.

Online when an API key is configured, otherwise offline files under the run dir (`wandb sync` later);
`WANDB_MODE` wins over both. The run id is kept in the run dir so that a resumed run continues the
same W&B run.
"""

import dataclasses
import netrc
import os
import secrets
import socket
import string
import sys
from enum import Enum
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from omegaconf import OmegaConf

from grpo_run.config.schema import Config, WandbMode
from grpo_run.tracking import console
from grpo_run.tracking.secrets import redact

RUN_ID_FILE = "wandb_run_id"
COMPLETIONS_KEY = "completions"
STEP_KEY = "step"
MULTIRUN_RECORD = "multirun.yaml"  # the basic sweeper writes it into the sweep dir before any job
_DEFAULT_HOST = "https://api.wandb.ai"
_REDACTED = "<redacted>"


def api_key_configured() -> bool:
    """True when wandb would find a key: WANDB_API_KEY or a netrc entry for the W&B host."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", _DEFAULT_HOST)).hostname
    path = Path(os.environ.get("NETRC") or Path.home() / ".netrc")
    try:
        entry = netrc.netrc(path).authenticators(host or "")
    except (OSError, netrc.NetrcParseError):
        return False
    return bool(entry and entry[2])


REACH_TIMEOUT_S = 10.0  # for a TCP connection to the W&B host before an online run starts


def unreachable(base_url: str, timeout_s: float) -> str | None:
    """None when a TCP connection to the W&B host opens within `timeout_s`, else why not (one phrase)."""
    url = urlparse(base_url)
    host = url.hostname or ""
    port = url.port or (80 if url.scheme == "http" else 443)
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as err:
        return f"the W&B host {base_url} is unreachable ({err.strerror or type(err).__name__})"
    return None


AUTO_ONLINE = "an API key is configured"  # online by default, not asked for: offline when unreachable


class WandbUnreachable(RuntimeError):
    """`logger.mode=online` (or WANDB_MODE=online) was asked for, and the W&B host cannot be reached."""


def choose_mode(configured: WandbMode | None) -> tuple[str, str]:
    """(mode, why): WANDB_MODE, else `logger.mode`, else online exactly when an API key is configured."""
    env = os.environ.get("WANDB_MODE")
    if env:
        return env, f"WANDB_MODE={env}"  # wandb's own spellings (dryrun, ...) pass through to wandb
    if configured is not None:
        return configured.value, f"logger.mode={configured.value}"
    if api_key_configured():
        return WandbMode.ONLINE.value, AUTO_ONLINE
    return WandbMode.OFFLINE.value, "no W&B API key configured (WANDB_API_KEY or ~/.netrc)"


def run_config(cfg: Config) -> dict[str, Any]:
    """The resolved config as plain data (enums by value); any string holding the API key is redacted."""
    data = OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)
    return _plain(data, os.environ.get("WANDB_API_KEY") or None)


def _plain(node: Any, secret: str | None) -> Any:
    if isinstance(node, dict):
        return {k: _plain(v, secret) for k, v in node.items()}
    if isinstance(node, list):
        return [_plain(v, secret) for v in node]
    if isinstance(node, Enum):
        return node.value
    if secret and isinstance(node, str) and secret in node:
        return _REDACTED
    if isinstance(node, str):
        return redact(node)
    return node


def _redacted(text: str | None) -> str | None:
    return None if text is None else redact(text)


def stored_run_id(run_dir: Path) -> str:
    """The W&B run id of this run dir: read back on resume, created and stored on the first start."""
    path = run_dir / RUN_ID_FILE
    if path.exists():
        return path.read_text().strip()
    # W&B's own id alphabet and length: 8 lowercase letters and digits.
    run_id = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))
    path.write_text(run_id + "\n")
    return run_id


class WandbSink:
    """One W&B run; `log` is called once per step, `log_completions` before it on table steps."""

    def __init__(self, cfg: Config) -> None:
        import wandb

        run_dir = Path(cfg.run_dir)
        lg = cfg.logger
        mode, why = choose_mode(lg.mode)
        if mode == WandbMode.ONLINE.value:
            problem = unreachable(os.environ.get("WANDB_BASE_URL", _DEFAULT_HOST), REACH_TIMEOUT_S)
            if problem is not None and why != AUTO_ONLINE:  # online was asked for: never quietly offline
                raise WandbUnreachable(
                    f"{why}, but {problem}; run with logger.mode=offline (and `wandb sync` later) or fix "
                    "the network"
                )
            if problem is not None:  # not wandb's own 90 s of retries and a CommError: offline, said once
                mode, why = (
                    WandbMode.OFFLINE.value,
                    f"{why}, but {problem}; logger.mode=offline skips this check",
                )
        offline = mode in (WandbMode.OFFLINE.value, "dryrun")
        self.run = wandb.init(
            project=lg.project,
            entity=lg.entity,
            # The run's identity is written to disk (the offline .wandb file) and uploaded: never a secret.
            group=_redacted(lg.group),
            name=_redacted(lg.name),
            tags=[redact(t) for t in lg.tags] or None,
            config=run_config(cfg),
            dir=str(run_dir),
            mode=mode,
            id=stored_run_id(run_dir),
            resume="allow",
            # Offline, our one line below replaces wandb's banner; online, its run link stays visible.
            # finish_timeout: W&B's own bound on the upload at the end (here, and in its exit hook); what is
            # left stays on disk for `wandb sync`. Half the stop bound, so a stopped run exits in time.
            settings=wandb.Settings(
                quiet=True, silent=offline, finish_timeout=finish_timeout_s(cfg.trainer.stop_within_s)
            ),
        )
        # Every key is plotted against the optimizer step, also across a resume.
        self.run.define_metric(STEP_KEY)
        self.run.define_metric("*", step_metric=STEP_KEY)
        self._pending: dict[str, Any] = {}
        if offline:
            files = Path(self.run.dir).parent
            line = f"W&B offline ({why}): {files} (upload later: wandb sync {files})"
            console.print(line, soft_wrap=True, markup=False, highlight=False)

    def log_completions(self, step: int, rows: list[dict[str, Any]]) -> None:
        """Kept until the step's metrics arrive, so that one W&B history row holds the whole step."""
        import wandb

        if rows:
            columns = list(rows[0])
            self._pending[COMPLETIONS_KEY] = wandb.Table(
                columns=columns, data=[[row[c] for c in columns] for row in rows]
            )

    def alert(self, title: str, text: str) -> None:
        import wandb

        self.run.alert(title=title[:63], text=text, level=wandb.AlertLevel.WARN)

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log({**values, **self._pending, STEP_KEY: step})
        self._pending = {}

    def close(self) -> None:
        """Called from the trainer's `finally`: a stop signal in flight marks the W&B run as preempted
        (`mark_preempting`, then exit code 75, W&B's contract for a run to be resumed), any other
        exception as failed (exit code 1)."""
        err = sys.exc_info()[1]
        if preempted(err):
            self.run.mark_preempting()
        self.run.finish(exit_code=exit_code(err))


def preempted(err: BaseException | None) -> bool:
    """A stop signal's exception (`safety.signals`: Preempted, LoadingStopped) carries the process's exit
    code, 75; read here by attribute, since tracking never imports safety."""
    return getattr(err, "exit_code", None) is not None


def exit_code(err: BaseException | None) -> int:
    """The exit code W&B records for a run ending with `err` in flight (None: it finished)."""
    if err is None:
        return 0
    return err.exit_code if preempted(err) else 1


def finish_timeout_s(stop_within_s: float) -> float:
    """How long `finish` may upload: half of `trainer.stop_within_s` (the other half is the stop and the
    save), at least 1 s."""
    return max(1.0, stop_within_s / 2)


def _choice_tags(choices: dict[str, str | None]) -> list[str]:
    """`model=tiny`, `reward=target_char`, ...: the config groups picked for this job."""
    return [f"{g}={c}" for g, c in choices.items() if c is not None and not g.startswith("hydra/")]


def _sweep_keys(sweeper_params: Any, sweep_dir: Path) -> list[str]:
    """The keys a multirun varies: its sweeper's `params` and the sweep overrides it was started with."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    keys = list(sweeper_params or {})
    record = sweep_dir / MULTIRUN_RECORD
    if record.exists():
        task = OmegaConf.to_container(OmegaConf.load(record).hydra.overrides.task, resolve=False)
        parsed = OverridesParser.create().parse_overrides([str(o) for o in task])
        keys += [o.key_or_group for o in parsed if o.is_sweep_override()]
    return keys


def _sweep_dir(hydra_cfg, run_dir: Path) -> Path | None:
    """The multirun this job belongs to: Hydra's sweep dir, or, for the ranks a multi-GPU job starts
    as plain runs in the job's dir, the parent holding the sweep's record."""
    from hydra.types import RunMode

    if hydra_cfg.mode == RunMode.MULTIRUN:
        return Path(hydra_cfg.sweep.dir)
    return run_dir.parent if (run_dir.parent / MULTIRUN_RECORD).exists() else None


def job_name(task_overrides: list[str], sweep_keys: list[str]) -> str | None:
    """`beta=0.04,epsilon=0.2,group_size=8`: this job's values of the swept keys (sorted), short names."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(task_overrides)
    swept = sorted((o for o in parsed if o.key_or_group in sweep_keys), key=lambda o: o.key_or_group)
    parts = [f"{o.key_or_group.split('.')[-1]}={o.get_value_element_as_str()}" for o in swept]
    return ",".join(parts) or None


def sweep_group(sweep_dir: str) -> str:
    """The sweep's id: its directory's last two parts (`<date>_<time>` under outputs/multirun)."""
    return "_".join(Path(sweep_dir).resolve().parts[-2:])


def with_hydra_identity(cfg: Config) -> Config:
    """Fill `logger.group` and `logger.name` (when null) and add the chosen groups to `logger.tags`.

    A multirun job joins the sweep's group under a name made of its swept values, so that W&B
    compares the jobs side by side. Values the user set are kept as they are.
    """
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return cfg
    hc = HydraConfig.get()
    lg = cfg.logger
    tags = list(dict.fromkeys([*lg.tags, *_choice_tags(dict(hc.runtime.choices))]))
    group, name = lg.group, lg.name
    sweep_dir = _sweep_dir(hc, Path(cfg.run_dir))
    if sweep_dir is not None:
        group = group or sweep_group(str(sweep_dir))
        name = name or job_name(list(hc.overrides.task), _sweep_keys(hc.sweeper.get("params"), sweep_dir))
    return dataclasses.replace(cfg, logger=dataclasses.replace(lg, group=group, name=name, tags=tags))
