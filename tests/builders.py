"""Builders several test modules share: typed configs composed in-process, fault injection, rank launches.

No test module imports another; what two need lives here (and in tests/helpers.py, the CLI runner)."""

import json
import os
import socket
import subprocess
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import open_dict

import grpo_run.entry as entry
import grpo_run.trainer as trainer
import grpo_run.update as update
from grpo_run.cli import CONF_DIR
from grpo_run.config import Config, to_config
from grpo_run.models import tiny
from grpo_run.models.tiny import ensure_tiny_model, write_tiny_model
from tests.helpers import FAST, GRPO_RUN


def compose_config(overrides: list[str]) -> Config:
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return to_config(compose(config_name="config", overrides=overrides))


QUIET = ["logger=console", "logger.console=false", "eval.every_steps=0"]


def config(overrides: list[str], run_dir: Path):
    """The typed config `grpo-run OVERRIDES` would run, writing to `run_dir` (for in-process runs)."""
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        raw = compose(config_name="config", overrides=overrides)
    with open_dict(raw):
        raw.run_dir = str(run_dir)
    return to_config(raw)


def run_here(overrides: list[str], run_dir: Path) -> Path:
    """`grpo-run OVERRIDES hydra.run.dir=RUN_DIR` in this process (`grpo_run.entry.run`, what the command
    runs once Hydra composed the config: config_resolved.yaml, metrics, checkpoints, final/ as the command
    writes them; Hydra's own .hydra/ aside); the run dir. For the runs a test needs as a starting point
    or a baseline, not the ones it examines as a command: it saves a process start (seconds of imports).
    It takes no run-dir lock (this process outlives the run) and leaves deepspeed importable."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(entry, "hold_run_dir", lambda run_dir: None)
        patch.setattr(entry, "keep_deepspeed_unimported", lambda: None)
        with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
            raw = compose(config_name="config", overrides=overrides)
        with open_dict(raw):
            raw.run_dir = str(run_dir)
        entry.run(to_config(raw), raw)
    return run_dir


def exit_code(overrides: list[str], run_dir: Path) -> int:
    """`run_here`'s exit code: what the command would exit with (0: it ran to its end)."""
    try:
        run_here(overrides, run_dir)
    except SystemExit as err:
        return err.code
    return 0


def write_tiny_teacher(out: Path, *, seed: int = 1, vocab_size: int | None = None) -> Path:
    """A tiny model folder for distill.teacher.path: the tiny model's tokenizer with other weights (seed),
    or with `vocab_size` a tokenizer and model of another vocabulary (a teacher of another family)."""
    saved = tiny.VOCAB_SIZE
    tiny.VOCAB_SIZE = vocab_size or saved
    try:
        tokenizer = tiny.build_tokenizer()
        tiny.build_model(tokenizer, seed=seed).save_pretrained(out)
    finally:
        tiny.VOCAB_SIZE = saved
    tokenizer.save_pretrained(out)
    cfg_path = out / "tokenizer_config.json"  # AutoTokenizer reloads this exact tokenizer (models/tiny.py)
    cfg_path.write_text(
        json.dumps({**json.loads(cfg_path.read_text()), "tokenizer_class": "PreTrainedTokenizerFast"})
    )
    return out


def whole_and_resumed(args: list[str], tmp_path: Path) -> tuple[Path, Path]:
    """`args` for 4 steps in one go (a checkpoint every step), then again from step 2's checkpoint, both
    in this process: (the whole run's dir, the resumed run's dir)."""
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    trainer.train(
        config([*args, "trainer.max_steps=4", "checkpoint.every_steps=1", "checkpoint.keep_last=4"], whole)
    )
    middle = whole / "checkpoints" / "step_00000002"
    trainer.train(config([*args, "trainer.max_steps=4", f"resume={middle}"], resumed))
    return whole, resumed


LEARN = [*FAST, "trainer.lr=3e-3", "grpo.beta=0.04", "trainer.warmup_steps=2", *QUIET]


def inject_nan_loss(monkeypatch, bad_steps) -> None:
    """Add NaN to the policy loss on `bad_steps`: the gradient stays finite, only the loss is NaN."""
    current = {"step": 0}
    real_step, real_loss = trainer.train_step, update.policy_loss

    def train_step(ctx, state, step):
        current["step"] = step
        return real_step(ctx, state, step)

    def policy_loss(*args, **kwargs):
        out = real_loss(*args, **kwargs)
        return out._replace(loss=out.loss + float("nan")) if bad_steps(current["step"]) else out

    monkeypatch.setattr(trainer, "train_step", train_step)
    monkeypatch.setattr(update, "policy_loss", policy_loss)


HOOKS = str(Path(__file__).parent / "integration" / "rank_hooks")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# Two CPU ranks. The port is this pytest process's own: `make test` runs two pytest workers, and two
# rank pairs rendezvousing on the default 29500 at once would join each other's run.
ZERO2 = ["distributed=zero2", "distributed.nproc_per_node=2", f"distributed.master_port={_free_port()}"]


def hook_env(**extra: str) -> dict[str, str]:
    path = os.pathsep.join(p for p in [HOOKS, os.environ.get("PYTHONPATH")] if p)
    return {**os.environ, "PYTHONPATH": path, **extra}


def run_in(cwd: Path, args: list[str], env: dict[str, str], timeout: float = 240):
    """`grpo-run ARGS` started in `cwd` with Hydra's default (timestamped) run dir under it."""
    cwd.mkdir(parents=True, exist_ok=True)
    return subprocess.run(
        [GRPO_RUN, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


def descendants(pid: int) -> set[int]:
    """Every live process below `pid` (children of children too), from /proc."""
    found, todo = set(), [pid]
    while todo:
        current = todo.pop()
        for task in Path(f"/proc/{current}/task").glob("*"):
            try:
                children = {int(c) for c in (task / "children").read_text().split()}
            except OSError:
                continue
            todo += children - found
            found |= children
    return found


def alive(pid: int) -> bool:
    """Running, sleeping or stopped; not gone and not a zombie waiting for its parent's wait."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def folder_with_own_code(tmp_path, model_type: str | None = None):
    """The tiny model saved as a folder, its config.json and tokenizer_config.json then given an auto_map
    naming `evil.py`, which would write `marker` if anything imported it. model_type: replaces the
    folder's (a known one: qwen2) with one only that code would define."""
    folder, marker = tmp_path / "with-own-code", tmp_path / "the-folders-code-ran"
    write_tiny_model(folder)
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel"}
    if model_type is not None:
        config["model_type"] = model_type
    (folder / "config.json").write_text(json.dumps(config))
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    tokenizer_config["auto_map"] = {"AutoTokenizer": ["evil.EvilTokenizer", None]}
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    (folder / "evil.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\nraise SystemExit(3)\n")
    return folder, marker


def tiny_classifier(folder: Path) -> Path:
    """A reward model built in code: the tiny model's body with a one-logit classification head
    (transformers' Qwen2ForSequenceClassification, its head seeded), and the tiny tokenizer, in `folder`."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    if (folder / "config.json").exists():
        return folder
    tiny = ensure_tiny_model(os.environ["GRPO_RUN_CACHE"])
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(tiny, num_labels=1)
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    model.config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
