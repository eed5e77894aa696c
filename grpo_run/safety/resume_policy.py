"""Which config keys may change when a run resumes (applied), and which may not (refused by name).

The checkpoint keeps the config it was trained with (`config.json`). On resume every key is compared:
a key under one of `MAY_CHANGE` is taken from the new command line (a table in docs/reliability.md says
what each does); any other changed key is an error naming it, its saved value and the new one, unless it
is listed in `resume_force=[key,...]`, which accepts it knowingly (the resumed run is then no longer the
run an uninterrupted one would have been).
"""

import json
from dataclasses import asdict
from enum import Enum
from pathlib import Path
from typing import Any

from grpo_run.config.schema import Config
from grpo_run.tracking.secrets import redact

CONFIG_FILE = "config.json"

# Applied on resume. Everything else (model, grpo.*, data.*, reward.functions, trainer.seed,
# trainer.prompts_per_step, the optimizer's knobs, generation sampling, kl_control) may not change.
MAY_CHANGE = (
    "trainer.max_steps",  # linear/cosine schedules stretch to the new end from the resumed step on
    "trainer.lr",  # the schedule's base lr: the next step runs at new lr x its schedule factor
    "trainer.device",
    "trainer.micro_batch_size",  # only how the step's fixed batch is split (the same loss)
    "trainer.max_consecutive_nonfinite",
    "trainer.fused_adamw",
    "trainer.skip_zero_advantage",  # rows with zero gradient left out: the same step
    "backend.",  # how the forward passes are computed: the same numbers (bf16_sampling_copy: to rounding)
    "generation.engine",
    "eval.",
    "logger.",
    "checkpoint.",
    "alerts.",  # in-flight alarms only watch the run
    "plan.",
    "reward.timeout_s",
    "reward.workers",  # how many processes score, not what they score
    "distributed.master_addr",
    "distributed.master_port",
    "distributed.timeout_s",  # how long ranks wait for each other, not what they compute
    # Where the groups are sampled: a resumed run regenerates the steps in flight from the checkpoint's
    # weights and sampler position in either mode (docs/rollouts.md).
    "rollout.",
    "model.cache_dir",
    "distill.teacher.device",  # where the frozen teacher runs: the same scores (to the device's rounding)
    "data.train_path",  # the same records may move; a changed record count is refused by the sampler
    "data.eval_path",
    "data.local_dir",  # GRPO_RUN_DATA: the same files in another folder (a preset's local_files)
    "data.eval_size",
    "mode",
    "resume",
    "resume_force",
    "run_dir",
)


class ResumeConfigError(ValueError):
    """A key that may not change on resume changed; exit 2 like any config error."""


class NothingToTrain(ResumeConfigError):
    """trainer.max_steps is below the checkpoint's step: the run would train nothing although it asks
    for steps the checkpoint has not run; exit 2 like any config error, before anything loads."""


class AlreadyTrained(Exception):
    """trainer.max_steps is the checkpoint's step: a finished run resumed (a requeued job, a rerun with
    resume=auto). Nothing to do: the run says so in one line and exits 0, writing nothing."""


def check_steps_left(max_steps: int, folder: Path, saved_step: int) -> None:
    """Raise unless resuming `folder` (at `saved_step`) leaves steps to train (docs/reliability.md)."""
    if max_steps > saved_step:
        return
    where = f"resume: the checkpoint {folder} is at step {saved_step}, trainer.max_steps={max_steps}"
    if max_steps == saved_step:
        raise AlreadyTrained(
            f"{where}: the run is already trained to its last step, nothing to do "
            f"(trainer.max_steps above {saved_step} continues it)"
        )
    raise NothingToTrain(
        f"{where}: nothing to train; raise trainer.max_steps above {saved_step} to continue "
        "(a checkpoint is never trained backwards)"
    )


def _plain(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: _plain(v) for k, v in node.items()}
    if isinstance(node, (list, tuple)):
        return [_plain(v) for v in node]
    if isinstance(node, Enum):
        return node.value
    if isinstance(node, str):
        return redact(node)  # the saved config is on disk: no secret; compared redacted on both sides
    return node


def flat(cfg: Config) -> dict[str, Any]:
    out: dict[str, Any] = {}

    def walk(prefix: str, node: Any) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(f"{prefix}{k}.", v)
        else:
            out[prefix[:-1]] = node

    walk("", _plain(asdict(cfg)))
    return out


def save_config(cfg: Config, folder: Path) -> None:
    (folder / CONFIG_FILE).write_text(json.dumps(flat(cfg), indent=1, sort_keys=True) + "\n")


def may_change(key: str) -> bool:
    return any(key == p or (p.endswith(".") and key.startswith(p)) for p in MAY_CHANGE)


def check_resume(cfg: Config, folder: Path) -> list[str]:
    """The changed keys that are applied (for one message); raise on a refused one. A checkpoint from
    before config.json existed is resumed unchecked."""
    path = folder / CONFIG_FILE
    if not path.is_file():
        return []
    saved = json.loads(path.read_text())
    now = flat(cfg)
    # A key the checkpoint's config lacks (added to the schema since) at its default is unchanged.
    defaults = flat(Config())
    changed = sorted(
        k
        for k in set(saved) | set(now)
        if saved.get(k) != now.get(k) and not (k not in saved and now.get(k) == defaults.get(k))
    )
    for key in changed:
        if not may_change(key) and key not in cfg.resume_force:
            raise ResumeConfigError(
                f"{key}={now.get(key)!r}: the checkpoint {folder} was trained with {key}={saved.get(key)!r}, "
                f"and {key} may not change on resume; resume_force=[{key}] resumes anyway "
                "(docs/reliability.md, resume policy)"
            )
    return [k for k in changed if k not in ("resume", "run_dir", "mode", "resume_force")]
