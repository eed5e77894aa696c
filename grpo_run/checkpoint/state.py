"""The loop's state file, `trainer_state.json`: its format, read back with every value checked by name."""

import json
import math
from dataclasses import dataclass, field, fields
from pathlib import Path

CHECKPOINTS = "checkpoints"
LATEST = "latest"
STATE_FILE = "trainer_state.json"
TMP_PREFIX = ".tmp-"
FORMAT_VERSION = 1
AUTO = "auto"


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or resumed; the message names the folder."""


@dataclass
class TrainerState:
    """What the loop itself needs to continue; JSON, so a person can read it."""

    step: int
    sampler: dict[str, int]
    beta: float
    nonfinite_streak: int
    world_size: int
    wandb_run_id: str | None
    version: int = FORMAT_VERSION
    alarms: dict = field(default_factory=dict)  # the in-flight alarms' streaks (tracking/alarms.py)
    # grpo.entropy_control=adaptive: the bonus coefficient and the last measured train/entropy (None:
    # no step measured one yet, or a fixed coefficient).
    entropy_coef: float | None = None
    last_entropy: float | None = None
    # The step's metrics when a stop cut its evaluation short: not logged yet. A resume evaluates the
    # step again and logs them with its eval/* once (None: the step is logged).
    unlogged: dict[str, float] | None = None
    # Steps in a row on which no reward function scored any completion (reward.max_failed_steps).
    reward_failed_streak: int = 0
    # Optimizer steps of step `step` + 1 already applied (grpo.num_iterations > 1: a stop between them);
    # that step's remainder (`grpo_run/step_remainder.py`) lies beside this file. 0: the next step starts
    # from its beginning.
    iterations_done: int = 0


def step_name(step: int) -> str:
    return f"step_{step:08d}"


def folder_name(state: TrainerState) -> str:
    """`step_<step>` for a whole step; `step_<step + 1>-iter<k>` for a state inside the next step, after its
    k-th optimizer step (so a whole checkpoint of either step never shares its folder)."""
    if state.iterations_done == 0:
        return step_name(state.step)
    return f"{step_name(state.step + 1)}-iter{state.iterations_done}"


def describe_position(state: TrainerState) -> str:
    """Where a checkpoint stands, in words: "step 4", or "step 4 and 1 optimizer step of step 5"."""
    if state.iterations_done == 0:
        return f"step {state.step}"
    steps = "optimizer step" if state.iterations_done == 1 else "optimizer steps"
    return f"step {state.step} and {state.iterations_done} {steps} of step {state.step + 1}"


def read_state(folder: Path) -> TrainerState:
    """The state file, every value checked by name: a torn or edited file never resumes half-read."""
    path = folder / STATE_FILE
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{path}: unreadable ({type(err).__name__}: {err})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: not a JSON object")
    if data.get("version") != FORMAT_VERSION:
        raise CheckpointError(f"{folder}: checkpoint format {data.get('version')}, expected {FORMAT_VERSION}")

    def count(key: str, low: int) -> None:
        value = data.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise CheckpointError(f"{path}: {key}={value!r} must be an integer >= {low}")

    count("step", 0)
    count("nonfinite_streak", 0)
    data.setdefault("reward_failed_streak", 0)  # checkpoints written before reward.max_failed_steps
    count("reward_failed_streak", 0)
    count("world_size", 1)
    data.setdefault("iterations_done", 0)  # checkpoints written before a stop could land inside a step
    count("iterations_done", 0)
    beta = data.get("beta")
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not math.isfinite(beta) or beta < 0:
        raise CheckpointError(f"{path}: beta={beta!r} must be a finite number >= 0")
    sampler = data.get("sampler")
    if not isinstance(sampler, dict) or not all(
        isinstance(v, int) and not isinstance(v, bool) for v in sampler.values()
    ):
        raise CheckpointError(f"{path}: sampler={sampler!r} must map names to integers")
    if not isinstance(data.get("wandb_run_id"), (str, type(None))):
        raise CheckpointError(f"{path}: wandb_run_id={data.get('wandb_run_id')!r} must be a string or null")
    data.setdefault("alarms", {})  # checkpoints written before the alarms existed
    alarms = data["alarms"]
    if not isinstance(alarms, dict) or not all(
        isinstance(v, list) if k == "fired" else isinstance(v, int) and not isinstance(v, bool) and v >= 0
        for k, v in alarms.items()
    ):
        raise CheckpointError(f"{path}: alarms={alarms!r} must map streak names to integers >= 0")
    for key in ("entropy_coef", "last_entropy"):
        data.setdefault(key, None)  # checkpoints written before the adaptive entropy bonus existed
        value = data[key]
        if value is not None and (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not math.isfinite(value)
            or value < 0
        ):
            raise CheckpointError(f"{path}: {key}={value!r} must be a finite number >= 0 or null")
    data.setdefault("unlogged", None)  # checkpoints written before a stop could cut an evaluation
    unlogged = data["unlogged"]
    if unlogged is not None and not (
        isinstance(unlogged, dict)
        and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in unlogged.values())
    ):
        raise CheckpointError(f"{path}: unlogged={unlogged!r} must map metric names to numbers, or be null")
    known = {f.name for f in fields(TrainerState)}
    if set(data) != known:
        raise CheckpointError(f"{path}: keys {sorted(data)}, expected {sorted(known)}")
    return TrainerState(**data)
