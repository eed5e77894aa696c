"""Checkpoint pieces on their own: RNG and engine state round trips, the non-finite skip, the `latest`
pointer and pruning, metrics trimming, the signal catcher, and validation of the reliability keys."""

import json
import os
import random
import signal
from dataclasses import asdict

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException

from grpo_run import checkpoint
from grpo_run.cli import CONF_DIR
from grpo_run.config import ConfigError, to_config
from grpo_run.config.schema import CheckpointConfig, LRScheduler
from grpo_run.engine.schedule import lr_factor
from grpo_run.engine.single import OPTIMIZER_FILE, SingleProcessEngine
from grpo_run.safety.signals import REQUEUE_SIGNAL, SignalCatcher, request_requeue
from grpo_run.update import nonfinite_to_grad


def tiny_engine(seed: int = 0) -> SingleProcessEngine:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    return SingleProcessEngine(
        model,
        lr=0.1,
        weight_decay=0.01,
        betas=(0.9, 0.99),
        lr_factor=lr_factor(LRScheduler.LINEAR, warmup_steps=3, max_steps=10),
        max_grad_norm=1.0,
        device=torch.device("cpu"),
    )


def train_once(engine: SingleProcessEngine, scale: float = 1.0) -> torch.Tensor:
    x = torch.arange(6.0).view(2, 3)
    engine.backward(engine.module(x).square().sum() * scale)
    return engine.step()


def test_rng_states_round_trip_through_weights_only_load(tmp_path):
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    np.random.standard_normal()  # leaves a cached Gaussian in numpy's state
    torch.save(checkpoint.rng_state(), tmp_path / "rng.pt")
    expected = (random.random(), np.random.standard_normal(3), torch.rand(3))
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    checkpoint.set_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))
    got = (random.random(), np.random.standard_normal(3), torch.rand(3))
    assert got[0] == expected[0]
    assert np.array_equal(got[1], expected[1])
    assert torch.equal(got[2], expected[2])


def test_engine_state_round_trips_weights_optimizer_and_schedule(tmp_path):
    a = tiny_engine(seed=0)
    train_once(a)
    train_once(a)
    a.save_state(tmp_path)
    b = tiny_engine(seed=1)  # other initial weights: everything must come from the files
    b.load_state(tmp_path)
    assert b.current_lr() == a.current_lr()
    train_once(a), train_once(b)
    for pa, pb in zip(a.module.parameters(), b.module.parameters(), strict=True):
        assert torch.equal(pa, pb)


def test_engine_state_never_unpickles_arbitrary_objects(tmp_path):
    a = tiny_engine()
    a.save_state(tmp_path)
    torch.save({"state": {}, "param_groups": [], "payload": os.system}, tmp_path / OPTIMIZER_FILE)
    with pytest.raises(Exception, match="Weights only load failed"):
        tiny_engine().load_state(tmp_path)


def test_a_non_finite_gradient_skips_the_update_entirely():
    engine = tiny_engine()
    train_once(engine)
    before = [p.detach().clone() for p in engine.module.parameters()]
    adam_before = {k: v.clone() for k, v in engine.optimizer.state_dict()["state"][0].items()}
    lr_before = engine.current_lr()

    norm = train_once(engine, scale=float("nan"))

    assert not torch.isfinite(norm)
    assert all(torch.equal(p, q) for p, q in zip(engine.module.parameters(), before, strict=True))
    assert all(p.grad is None for p in engine.module.parameters())  # nothing carried into the next step
    for key, value in engine.optimizer.state_dict()["state"][0].items():
        assert torch.equal(value, adam_before[key]), key
    assert engine.current_lr() == lr_before  # the schedule did not advance
    assert torch.isfinite(train_once(engine))  # and the next good step trains again


def test_nonfinite_to_grad_keeps_finite_gradients_and_poisons_the_rest():
    w = torch.tensor([1.0, 2.0], requires_grad=True)
    nonfinite_to_grad((w * 3).sum()).backward()
    assert torch.equal(w.grad, torch.tensor([3.0, 3.0]))  # exactly, not approximately
    w.grad = None
    # A NaN in a term without parameters: the plain gradient would be finite (3, 3).
    nonfinite_to_grad((w * 3).sum() + torch.tensor(float("nan"))).backward()
    assert torch.isnan(w.grad).all()


def fake_checkpoint(root, step: int, *, complete: bool = True):
    folder = root / checkpoint.step_name(step)
    folder.mkdir(parents=True)
    if complete:
        (folder / checkpoint.STATE_FILE).write_text(json.dumps(asdict(state_at(step))))
    return folder


def state_at(step: int) -> checkpoint.TrainerState:
    return checkpoint.TrainerState(
        step=step, sampler={"epoch": 0}, beta=0.0, nonfinite_streak=0, world_size=1, wandb_run_id=None
    )


def test_latest_wins_and_unfinished_or_stateless_folders_are_never_picked(tmp_path):
    assert checkpoint.newest_complete(tmp_path) is None
    two = fake_checkpoint(tmp_path, 2)
    fake_checkpoint(tmp_path, 3, complete=False)  # renamed but without its state file
    (tmp_path / f"{checkpoint.TMP_PREFIX}{checkpoint.step_name(4)}").mkdir()  # killed mid-write
    assert checkpoint.newest_complete(tmp_path) == two
    one = fake_checkpoint(tmp_path, 1)
    (tmp_path / checkpoint.LATEST).write_text(one.name + "\n")
    assert checkpoint.newest_complete(tmp_path) == one  # the pointer is the authority
    (tmp_path / checkpoint.LATEST).write_text("step_00000099\n")  # dangling: the newest written
    assert checkpoint.newest_complete(tmp_path) == one


def test_prune_keeps_the_newest_written_and_the_latest(tmp_path):
    folders = [fake_checkpoint(tmp_path, s) for s in (5, 6, 7, 8)]
    for i, folder in enumerate(folders):  # written in this order
        os.utime(folder / checkpoint.STATE_FILE, ns=(i * 10**9, i * 10**9))
    (tmp_path / checkpoint.LATEST).write_text(folders[0].name)  # e.g. resumed from step 5, re-saved
    checkpoint.prune(tmp_path, keep_last=2)
    assert sorted(p.name for p in checkpoint.complete_checkpoints(tmp_path)) == [
        checkpoint.step_name(5),
        checkpoint.step_name(7),
        checkpoint.step_name(8),
    ]


def test_checkpoints_written_within_one_clock_tick_are_ordered_by_step(tmp_path):
    """One mtime for all (a coarse file-system clock): prune keeps, and auto-resume picks, the highest steps."""
    folders = [fake_checkpoint(tmp_path, s) for s in (7, 5, 8, 6)]
    for folder in folders:
        os.utime(folder / checkpoint.STATE_FILE, ns=(10**9, 10**9))
    assert checkpoint.newest_complete(tmp_path) == tmp_path / checkpoint.step_name(8)  # no `latest`
    checkpoint.prune(tmp_path, keep_last=2)
    assert sorted(p.name for p in checkpoint.complete_checkpoints(tmp_path)) == [
        checkpoint.step_name(7),
        checkpoint.step_name(8),
    ]


def test_find_resume_accepts_a_checkpoint_a_run_dir_or_auto(tmp_path):
    run_dir = tmp_path / "run"
    assert checkpoint.find_resume(None, run_dir) is None
    assert checkpoint.find_resume("auto", run_dir) is None  # nothing yet: a fresh start
    folder = fake_checkpoint(run_dir / checkpoint.CHECKPOINTS, 3)
    assert checkpoint.find_resume("auto", run_dir) == folder
    assert checkpoint.find_resume(str(run_dir), tmp_path) == folder
    assert checkpoint.find_resume(str(folder), tmp_path) == folder
    with pytest.raises(checkpoint.CheckpointError, match="no complete checkpoint"):
        checkpoint.find_resume(str(tmp_path), tmp_path)


def test_resume_trims_metrics_past_the_checkpoint_and_keeps_the_wandb_id(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    rows = [{"step": s, "train/loss": 0.1 * s} for s in range(0, 6)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 6, "tr')
    folder = fake_checkpoint(tmp_path / "other", 3)
    state = checkpoint.TrainerState(3, {}, 0.0, 0, 1, "abc123")
    (folder / checkpoint.STATE_FILE).write_text(json.dumps(state.__dict__))
    checkpoint.prepare_run_dir(run_dir, folder, start_step=3)
    kept = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert kept == [0, 1, 2, 3]  # rows 4, 5 and the torn row 6 are trained and logged again
    assert (run_dir / "wandb_run_id").read_text().strip() == "abc123"
    checkpoint.prepare_run_dir(run_dir, None, start_step=0)  # resume=auto that found nothing
    assert (run_dir / "metrics.jsonl").read_text() == ""


def test_checkpoint_due_every_n_steps_and_at_the_end():
    cfg = CheckpointConfig(every_steps=3, save_final=True)
    assert [s for s in range(1, 8) if checkpoint.is_due(cfg, s, 7)] == [3, 6, 7]
    cfg = CheckpointConfig(every_steps=0, save_final=False)
    assert not any(checkpoint.is_due(cfg, s, 7) for s in range(1, 8))


def test_stop_signals_are_recorded_and_a_second_one_is_ignored():
    previous = signal.getsignal(signal.SIGTERM)
    with SignalCatcher() as catcher:
        assert not catcher.received
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGUSR1)  # still alive: only recorded
        assert catcher.received and catcher.signum == signal.SIGTERM  # the first one is kept
    # The process is stopping: stop signals are now ignored at the C level (SIG_IGN), which the
    # interpreter's shutdown leaves in place, so a late second SIGTERM cannot kill the exit.
    assert signal.getsignal(signal.SIGTERM) == signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN
    os.kill(os.getpid(), signal.SIGTERM)  # still alive
    for signum in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(signum, previous if signum == signal.SIGTERM else signal.SIG_DFL)
    with SignalCatcher():  # no signal: the previous handlers come back
        pass
    assert signal.getsignal(signal.SIGTERM) == previous


def test_requeue_only_for_sigusr1_under_slurm_when_enabled(monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert not request_requeue(REQUEUE_SIGNAL, enabled=True)  # not under Slurm
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("PATH", "/nonexistent")  # and no scontrol: the job cannot be requeued
    assert not request_requeue(signal.SIGTERM, enabled=True)
    assert not request_requeue(REQUEUE_SIGNAL, enabled=False)
    assert not request_requeue(REQUEUE_SIGNAL, enabled=True)


@pytest.mark.parametrize(
    "override,key,error",
    [
        ("checkpoint.every_steps=-1", "checkpoint.every_steps", ConfigError),
        ("checkpoint.keep_last=0", "checkpoint.keep_last", ConfigError),
        ("trainer.max_consecutive_nonfinite=0", "trainer.max_consecutive_nonfinite", ConfigError),
        ("resume=/no/such/checkpoint", "resume", ConfigError),
        ("checkpoint.keep_lats=3", "keep_lats", ConfigCompositionException),  # typo
        ("checkpoint.slurm_requeue=maybe", "slurm_requeue", ConfigCompositionException),  # not a bool
    ],
)
def test_bad_reliability_values_fail_naming_the_key(override, key, error):
    with pytest.raises(error, match=key.replace(".", r"\.")):
        with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
            to_config(compose(config_name="config", overrides=[override]))


# ---------------------------------------------------------------------------- damaged checkpoints


def saved_checkpoint(root, step: int):
    """A checkpoint folder as `save` leaves it: weights, state, and the manifest written last."""
    folder = fake_checkpoint(root, step)
    (folder / "model.safetensors").write_bytes(bytes(range(256)) * 64)
    checkpoint.write_manifest(folder)
    os.utime(folder / checkpoint.STATE_FILE, ns=(step * 10**9, step * 10**9))
    (root / checkpoint.LATEST).write_text(folder.name + "\n")
    return folder


def zero_bytes(path):
    path.write_bytes(bytes(path.stat().st_size))  # same size, contents gone


def truncate(path):
    path.write_bytes(path.read_bytes()[:100])


def tear_state(path):
    path.write_text(path.read_text()[:20])


DAMAGES = [
    ("model.safetensors", zero_bytes, "its checksum differs from the manifest's"),
    ("model.safetensors", truncate, "100 bytes, the manifest says 16384 (truncated or torn)"),
    (checkpoint.STATE_FILE, tear_state, "unreadable (JSONDecodeError"),
]


@pytest.mark.parametrize("name,damage,reason", DAMAGES)
def test_a_damaged_latest_is_reported_by_path_and_the_newest_intact_one_used(
    tmp_path, name, damage, reason, capfd
):
    one = saved_checkpoint(tmp_path, 1)
    two = saved_checkpoint(tmp_path, 2)
    damage(two / name)
    assert checkpoint.newest_intact(tmp_path) == one
    captured = capfd.readouterr()
    out = (captured.out + captured.err).replace("\n", "")
    assert f"{two / name}: {reason}" in out
    damage(one / name)
    with pytest.raises(checkpoint.CheckpointError, match="no intact checkpoint") as err:
        checkpoint.newest_intact(tmp_path)
    assert str(two / name) in str(err.value)
    with pytest.raises(checkpoint.CheckpointError, match=f"resume={two}: "):
        checkpoint.find_resume(str(two), tmp_path)  # named explicitly: stop, never another one


def test_a_non_utf8_latest_and_a_symlinked_folder_are_never_resumed(tmp_path):
    one = saved_checkpoint(tmp_path / "run", 1)
    outside = saved_checkpoint(tmp_path / "elsewhere", 5)
    (tmp_path / "run" / checkpoint.step_name(9)).symlink_to(outside, target_is_directory=True)
    (tmp_path / "run" / checkpoint.LATEST).write_bytes(b"\xff\xfe step_00000009\n")
    assert checkpoint.newest_intact(tmp_path / "run") == one
    (tmp_path / "run" / checkpoint.LATEST).write_text(checkpoint.step_name(9) + "\n")
    assert checkpoint.newest_intact(tmp_path / "run") == one  # `latest` names the symlink: skipped
    checkpoint.prune(tmp_path / "run", keep_last=1)
    assert (outside / "model.safetensors").exists()  # pruning never followed it out of the run dir


BAD_STATES = [
    ("step", -1),
    ("step", 2.5),
    ("step", "3"),
    ("nonfinite_streak", -2),
    ("iterations_done", -1),
    ("beta", float("inf")),
    ("world_size", 0),
    ("sampler", {"epoch": "x"}),
]


@pytest.mark.parametrize("key,value", BAD_STATES)
def test_trainer_state_values_are_validated_by_name(tmp_path, key, value):
    folder = fake_checkpoint(tmp_path, 1)
    data = asdict(state_at(1)) | {key: value}
    (folder / checkpoint.STATE_FILE).write_text(json.dumps(data))
    with pytest.raises(checkpoint.CheckpointError, match=f"{key}="):
        checkpoint.read_state(folder)
