"""Nothing trains silently wrong (issue #56), on the tiny model: a resume trains exactly the requested
steps on the batches an uninterrupted run draws, or says in one line why it trains nothing; an update
that moves no weight fires an alarm; every scored completion is trained or counted as dropped.

The checks themselves, fed by hand: tests/test_safety_checks.py."""

import pytest
import torch
from safetensors.torch import load_file

import grpo_run.engine.build as build
import grpo_run.engine.single as single
import grpo_run.run_context as run_context
import grpo_run.trainer as trainer
from grpo_run import checkpoint
from grpo_run import metrics as M
from grpo_run.data.sampler import PromptSampler
from grpo_run.rollout.groups import select_groups
from grpo_run.rollout.source import SyncRollouts
from grpo_run.safety.accounting import SampleAccountingError
from tests.builders import LEARN, QUIET, config, exit_code
from tests.helpers import FAST, read_metrics

# ------------------------------------------------------------------------- resume at an epoch boundary

# 5 records and 2 prompts a step: an epoch is 2 batches (one record left out, another each epoch), so
# step 2 is the last batch of epoch 0 and step 3 the first of epoch 1.
EPOCHS = [
    *LEARN,
    "data.train_size=5",
    "trainer.max_steps=5",
    "checkpoint.every_steps=1",
    "checkpoint.keep_last=5",
]


def without_timings(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if not k.startswith("perf/")} for row in rows]


def ckpt(run_dir, step: int):
    return run_dir / checkpoint.CHECKPOINTS / checkpoint.step_name(step)


def record_batches(mp: pytest.MonkeyPatch) -> list[list[str]]:
    """Every batch the run's prompt sampler hands out, as its questions, in order."""
    drawn: list[list[str]] = []
    real = PromptSampler.next_batch

    def next_batch(self):
        batch = real(self)
        drawn.append([e.question for e in batch])
        return batch

    mp.setattr(PromptSampler, "next_batch", next_batch)
    return drawn


@pytest.fixture(scope="module")
def five_steps(tmp_path_factory, _cache_dir):
    """5 steps in one go, a checkpoint after each, and the batches they drew."""
    run_dir = tmp_path_factory.mktemp("epochs") / "whole"
    with pytest.MonkeyPatch.context() as mp:
        drawn = record_batches(mp)
        trainer.train(config(EPOCHS, run_dir))
    assert len(drawn) == 5 and len({tuple(b) for b in drawn}) > 2
    return run_dir, drawn


def resume_from(step: int, whole, tmp_path, monkeypatch) -> tuple[list[list[str]], list[dict]]:
    drawn = record_batches(monkeypatch)
    resumed = tmp_path / f"from_{step}"
    trainer.train(config([*EPOCHS, f"resume={ckpt(whole, step)}"], resumed))
    return drawn, read_metrics(resumed)


def assert_continues_the_whole_run(whole, resumed, step: int, drawn, seen) -> None:
    assert drawn == seen[step:]  # the batches the uninterrupted run drew from that step on
    assert [r["step"] for r in read_metrics(resumed)] == list(range(step + 1, 6))
    assert without_timings(read_metrics(resumed)) == without_timings(read_metrics(whole))[step:]
    final, again = (
        load_file(whole / "final" / "model.safetensors"),
        load_file(resumed / "final" / "model.safetensors"),
    )
    assert all(torch.equal(final[k], again[k]) for k in final)


def test_a_resume_at_the_epoch_boundary_trains_the_batches_an_uninterrupted_run_draws(
    five_steps, tmp_path, monkeypatch
):
    whole, seen = five_steps
    # The checkpoint of step 2 stands at the end of epoch 0 (4 of its 5 records handed out).
    sampler = checkpoint.read_state(ckpt(whole, 2)).sampler
    assert (sampler["epoch"], sampler["position"]) == (0, 4)
    drawn, _ = resume_from(2, whole, tmp_path, monkeypatch)
    assert_continues_the_whole_run(whole, tmp_path / "from_2", 2, drawn, seen)
    # The comparison has teeth: a resume that rebuilt the sampler instead of restoring it would train
    # epoch 0's batches again.
    monkeypatch.setattr(run_context, "restore_sampler", lambda *args: None)
    drawn, rows = resume_from(2, whole, tmp_path / "rebuilt", monkeypatch)
    assert drawn == seen[:3] and drawn != seen[2:]


def test_a_resume_inside_an_epoch_continues_across_the_next_ones(five_steps, tmp_path, monkeypatch):
    whole, seen = five_steps
    sampler = checkpoint.read_state(ckpt(whole, 1)).sampler
    assert (sampler["epoch"], sampler["position"]) == (0, 2)
    drawn, _ = resume_from(1, whole, tmp_path, monkeypatch)  # steps 2-5: epochs 0, 1 and 2
    assert_continues_the_whole_run(whole, tmp_path / "from_1", 1, drawn, seen)


# ------------------------------------------------------------------- resume with nothing left to train


def test_max_steps_at_or_below_the_checkpoint_trains_nothing_says_why_and_writes_nothing(tmp_path, capsys):
    """Below the checkpoint's step: exit 2 (asked for steps it cannot train). At it: a finished run
    resumed, exit 0. Either way one line says why, and metrics.jsonl and final/ are left as they were."""
    args = [*FAST, *QUIET, "backend.tune_allocator=false"]
    run_dir = tmp_path / "run"
    trainer.train(config(args, run_dir))  # 2 steps
    kept = [run_dir / "metrics.jsonl", run_dir / "final" / "model.safetensors"]
    before = [(p.read_bytes(), p.stat().st_mtime_ns) for p in kept]
    capsys.readouterr()

    assert exit_code([*args, "trainer.max_steps=1", "resume=auto"], run_dir) == 2
    err = capsys.readouterr().err
    (line,) = [x for x in err.splitlines() if "nothing to train" in x]
    assert f"{ckpt(run_dir, 2)} is at step 2, trainer.max_steps=1: nothing to train" in line
    assert "raise trainer.max_steps above 2" in line and "resumed from" not in err

    assert exit_code([*args, "trainer.max_steps=2", "resume=auto"], run_dir) == 0
    err = capsys.readouterr().err
    (line,) = [x for x in err.splitlines() if "already trained" in x]
    assert "is at step 2, trainer.max_steps=2: the run is already trained to its last step" in line
    assert "resumed from" not in err and "done" not in err
    assert [(p.read_bytes(), p.stat().st_mtime_ns) for p in kept] == before


# ------------------------------------------------------------------- an update that changes nothing


def test_an_optimizer_with_lr_0_fires_weights_unchanged_once(tmp_path, monkeypatch, capsys):
    """trainer.lr must be > 0, so lr 0 stands for an optimizer or schedule that lost its learning rate."""
    monkeypatch.setattr(build, "learning_rate", lambda cfg: 0.0)
    run_dir = tmp_path / "run"
    trainer.train(config([*FAST, *QUIET], run_dir))
    rows = read_metrics(run_dir)
    assert all(r[M.GRAD_NORM] > 0 and r[M.UPDATE_NORM] == 0 for r in rows)
    assert [r[M.ALERT_WEIGHTS_UNCHANGED] for r in rows] == [1, 1]
    err = capsys.readouterr().err
    assert err.count("alerts/weights_unchanged") == 1 and "the run trains nothing" in err


LORA = [*FAST, *QUIET, "lora=default", "lora.r=4", "lora.alpha=8", "lora.lr=3e-2"]


def test_lora_whose_optimizer_holds_other_tensors_than_the_model_fires_weights_unchanged(
    tmp_path, monkeypatch, capsys
):
    """A broken LoRA set-up: the optimizer steps copies of the adapters (as when an adapter is wrapped or
    replaced after the optimizer is built); the forward pass's adapters get gradients and never move. A
    healthy LoRA run moves them and stays quiet."""
    healthy = tmp_path / "healthy"
    trainer.train(config([*LORA, "trainer.max_steps=1"], healthy))
    (row,) = read_metrics(healthy)
    assert row[M.UPDATE_NORM] > 0 and row[M.ALERT_WEIGHTS_UNCHANGED] == 0

    real = single.adamw_with_schedule

    def on_copies(model, **kwargs):
        copies = [torch.nn.Parameter(p.detach().clone()) for p in model.parameters() if p.requires_grad]
        return real(torch.nn.ParameterList(copies), **kwargs)

    monkeypatch.setattr(single, "adamw_with_schedule", on_copies)
    broken = tmp_path / "broken"
    trainer.train(config(LORA, broken))
    rows = read_metrics(broken)
    assert all(r[M.GRAD_NORM] > 0 and r[M.UPDATE_NORM] == 0 for r in rows)
    assert [r[M.ALERT_WEIGHTS_UNCHANGED] for r in rows] == [1, 1]
    assert capsys.readouterr().err.count("alerts/weights_unchanged") == 1


# ------------------------------------------------------ every scored completion trained or dropped

SETTINGS = {
    "plain": [],
    # G = 2 and two-token completions: many groups score the same twice (dropped), some rounds find
    # more informative groups than they need (surplus).
    "dynamic_sampling": [
        "grpo.filter_zero_std=true",
        "grpo.max_resample_rounds=4",
        "trainer.prompts_per_step=4",
        "grpo.group_size=2",
        "generation.max_new_tokens=2",
    ],
    # 48 new tokens: the tiny model ends some completions and cuts the rest, which leave the loss.
    "mask_truncated": [
        "grpo.mask_truncated=true",
        "generation.max_new_tokens=48",
        "trainer.prompts_per_step=4",
        "trainer.micro_batch_size=8",
    ],
    "both_mu_2": [
        "grpo.filter_zero_std=true",
        "grpo.max_resample_rounds=3",
        "grpo.mask_truncated=true",
        "generation.max_new_tokens=24",
        "grpo.group_size=2",
        "trainer.prompts_per_step=4",
        "grpo.num_iterations=2",
        "trainer.skip_zero_advantage=true",
    ],
}
EXERCISED = {  # the causes each setting must have dropped by at least once in its 3 steps
    "plain": [],
    "dynamic_sampling": [M.DROPPED_ZERO_STD, M.DROPPED_SURPLUS],
    "mask_truncated": [M.DROPPED_MASKED],
    "both_mu_2": [M.DROPPED_MASKED],
}


@pytest.mark.parametrize("setting", SETTINGS)
def test_every_scored_completion_is_trained_or_counted_as_dropped(tmp_path, setting):
    run_dir = tmp_path / "run"
    trainer.train(config([*FAST, *QUIET, "trainer.max_steps=3", *SETTINGS[setting]], run_dir))
    rows = read_metrics(run_dir)
    cfg = config([*FAST, *SETTINGS[setting]], run_dir)
    completions = cfg.trainer.prompts_per_step * cfg.grpo.group_size
    for row in rows:
        dropped = sum(row[k] for k in M.DROPPED_KEYS)
        assert row[M.SCORED_COMPLETIONS] == row[M.TRAINED_COMPLETIONS] + dropped, row
        assert row[M.SCORED_COMPLETIONS] == completions * row[M.GENERATION_ROUNDS]  # every round scored
        assert row[M.DROPPED_ZERO_STD] == cfg.grpo.group_size * row[M.DROPPED_GROUPS]
        if row.get(M.GRAD_NORM, 0) > 0:  # an update with a gradient moved the weights, and no alarm
            assert row[M.UPDATE_NORM] > 0 and row[M.ALERT_WEIGHTS_UNCHANGED] == 0
    for key in EXERCISED[setting]:
        assert sum(r[key] for r in rows) > 0, key
    assert sum(r[M.TRAINED_COMPLETIONS] for r in rows) > 0


def test_a_stage_that_loses_completions_stops_the_run_naming_the_step(tmp_path, monkeypatch):
    """A stand-in bug: the rollout source hands over one group fewer than it scored, uncounted."""
    real = SyncRollouts.sample

    def loses_a_group(self, step, stats):
        sampled = real(self, step, stats)
        groups = sampled.groups
        fewer = select_groups(groups, list(range(len(groups.examples) - 1)), groups.rewards.size(1))
        return sampled._replace(groups=fewer)

    monkeypatch.setattr(SyncRollouts, "sample", loses_a_group)
    with pytest.raises(SampleAccountingError, match="step 1: 8 completions were scored, 4 trained and 0"):
        trainer.train(config([*FAST, *QUIET], tmp_path / "run"))
