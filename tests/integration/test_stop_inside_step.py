"""A stop between the optimizer steps of one step (grpo.num_iterations = μ = 3) saves the state after the
last optimizer step with the rest of the step, and `resume=auto` finishes the step: the run then equals
the uninterrupted one bit for bit (weights, Adam state, every step's metrics but perf/* timings, each step
logged once).

The stop is requested from inside the update's n-th micro-batch forward pass (`update.student_pass`):
the flag is then pending at the next micro-batch's stop point, exactly as a signal arriving during that
micro-batch would leave it. With 8 completions a step in micro-batches of 4, each pass has 2
micro-batches: step 1 makes calls 1-6, step 2's passes calls 7-8, 9-10 and 11-12.
"""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import grpo_run.update as update
from grpo_run import checkpoint
from grpo_run import metrics as M
from grpo_run.safety.signals import EXIT_PREEMPTED
from grpo_run.safety.stop import request_stop
from grpo_run.step_remainder import REMAINDER, load_remainder
from tests.builders import LEARN, exit_code, run_here, write_tiny_teacher
from tests.helpers import read_metrics

STEPS = [*LEARN, "grpo.num_iterations=3", "aggregation=per_token", "trainer.max_steps=3"]
ARGS = [*STEPS, "trainer.padding_free=false"]  # padded: micro-batches of 4 rows, as counted above
# Packed micro-batches, one row each (every row is over a budget of 1): 8 calls a pass, step 2's passes
# calls 25-32, 33-40 and 41-48.
PACKED = [*STEPS, "trainer.padding_free=true", "trainer.micro_batch_tokens=1"]
# LoRA adapters with dropout: every training forward pass draws from the RNG, so the resume is exact
# only with the RNG states taken right after the last optimizer step (not when the stop was seen).
DROPOUT = [
    *ARGS,
    "lora=default",
    "lora.r=4",
    "lora.alpha=8",
    "lora.lr=3e-2",
    "lora.dropout=0.5",
    "model.disable_dropout=false",
]
INSIDE_STEP_2 = checkpoint.CHECKPOINTS + "/step_00000002-iter{k}"


def without_timings(rows: list[dict]) -> list[list]:
    """Each row's (key, value) pairs in the order logged, timings (perf/*, the teacher's seconds) left out."""
    return [
        [(k, v) for k, v in row.items() if not k.startswith("perf/") and k != M.DISTILL_TEACHER_S]
        for row in rows
    ]


def stop_in_call(monkeypatch, nth: int) -> None:
    """Ask this process to stop during the update's `nth` micro-batch forward pass (counted from 1)."""
    real, calls = update.student_pass, [0]

    def counting(*args, **kwargs):
        calls[0] += 1
        if calls[0] == nth:
            request_stop()
        return real(*args, **kwargs)

    monkeypatch.setattr(update, "student_pass", counting)


def stopped_at(monkeypatch, run_dir: Path, nth: int, args=ARGS) -> int:
    with monkeypatch.context() as patch:
        stop_in_call(patch, nth)
        return exit_code(args, run_dir)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """args -> the run dir of `args` trained in one go (once per module)."""
    runs: dict[tuple, Path] = {}

    def whole(args: list[str]) -> Path:
        if tuple(args) not in runs:
            runs[tuple(args)] = run_here(args, tmp_path_factory.mktemp("whole") / "run")
        return runs[tuple(args)]

    return whole


def weights(folder: Path) -> dict[str, torch.Tensor]:
    """Every safetensors file of a folder (a full model's, or LoRA's adapters)."""
    return {f"{p.name}:{k}": v for p in sorted(folder.glob("*.safetensors")) for k, v in load_file(p).items()}


def assert_equals_uninterrupted(run_dir: Path, whole: Path) -> None:
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3]  # every step logged once
    assert without_timings(rows) == without_timings(read_metrics(whole))
    ours, theirs = weights(run_dir / "final"), weights(whole / "final")
    assert ours and ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    name = checkpoint.step_name(3)
    adam = torch.load(run_dir / checkpoint.CHECKPOINTS / name / "optimizer.pt", weights_only=True)
    adam_whole = torch.load(whole / checkpoint.CHECKPOINTS / name / "optimizer.pt", weights_only=True)
    for i, state in adam_whole["state"].items():
        for key, value in state.items():
            assert torch.equal(value, adam["state"][i][key]), (i, key)


@pytest.mark.parametrize(
    "args, nth, done",
    [(ARGS, 8, 1), (ARGS, 9, 1), (ARGS, 10, 2), (DROPOUT, 9, 1), (PACKED, 33, 1)],
    ids=[
        "after pass 1",
        "inside pass 2",
        "after pass 2",
        "inside pass 2 with dropout",
        "inside pass 2 packed",
    ],
)
def test_a_stop_between_optimizer_steps_resumes_to_the_uninterrupted_run(
    tmp_path, monkeypatch, uninterrupted, args, nth, done
):
    """Call 8 ends pass 1 of step 2 (the stop is seen at pass 2's first micro-batch); call 9 is pass 2's
    first micro-batch (the stop is seen at its second: the pass is dropped); call 10 ends pass 2."""
    run_dir = tmp_path / "run"
    assert stopped_at(monkeypatch, run_dir, nth, args) == EXIT_PREEMPTED
    folder = run_dir / INSIDE_STEP_2.format(k=done)
    assert (run_dir / checkpoint.CHECKPOINTS / checkpoint.LATEST).read_text().strip() == folder.name
    state = checkpoint.read_state(folder)
    assert (state.step, state.iterations_done) == (1, done)
    manifest = json.loads((folder / checkpoint.MANIFEST).read_text())["files"]
    assert REMAINDER.format(rank=0) in manifest  # a folder missing it is never taken for complete
    assert [r["step"] for r in read_metrics(run_dir)] == [1]  # step 2 is not logged yet

    assert exit_code([*args, "resume=auto"], run_dir) == 0
    assert_equals_uninterrupted(run_dir, uninterrupted(args))


def test_a_stop_inside_a_pass_goes_back_to_the_last_optimizer_step(tmp_path, monkeypatch):
    """Stopped as pass 2 of step 2 ends (call 10) and stopped inside pass 3 (call 11): the second keeps the
    weights and Adam state after pass 2, the backward pass of pass 3's first micro-batch left out."""
    saved = {}
    for nth in (10, 11):
        run_dir = tmp_path / f"stop_{nth}"
        assert stopped_at(monkeypatch, run_dir, nth) == EXIT_PREEMPTED
        saved[nth] = run_dir / INSIDE_STEP_2.format(k=2)
    a, b = (load_file(saved[n] / "model.safetensors") for n in (10, 11))
    assert all(torch.equal(a[k], b[k]) for k in a)
    adam_a, adam_b = (torch.load(saved[n] / "optimizer.pt", weights_only=True) for n in (10, 11))
    for i, state in adam_a["state"].items():
        for key, value in state.items():
            assert torch.equal(value, adam_b["state"][i][key]), (i, key)


def test_a_resumed_step_stopped_again_keeps_its_checkpoint_and_still_resumes_exactly(
    tmp_path, monkeypatch, uninterrupted
):
    """Resumed inside step 2 after pass 1 and stopped again in pass 2's first micro-batch: nothing new is
    saved (the checkpoint is already this state) and a second resume still ends where one run ends."""
    run_dir = tmp_path / "run"
    assert stopped_at(monkeypatch, run_dir, 8) == EXIT_PREEMPTED
    folder = run_dir / INSIDE_STEP_2.format(k=1)
    written = (folder / checkpoint.STATE_FILE).stat().st_mtime_ns
    assert stopped_at(monkeypatch, run_dir, 1, [*ARGS, "resume=auto"]) == EXIT_PREEMPTED
    assert (folder / checkpoint.STATE_FILE).stat().st_mtime_ns == written
    assert exit_code([*ARGS, "resume=auto"], run_dir) == 0
    assert_equals_uninterrupted(run_dir, uninterrupted(ARGS))


def test_a_checkpoint_inside_a_step_without_its_remainder_is_refused_naming_the_file(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    assert stopped_at(monkeypatch, run_dir, 8) == EXIT_PREEMPTED
    folder = run_dir / INSIDE_STEP_2.format(k=1)
    (folder / REMAINDER.format(rank=0)).unlink()
    assert checkpoint.damage(folder) == f"{folder / REMAINDER.format(rank=0)}: missing"
    with pytest.raises(checkpoint.CheckpointError, match="step_remainder_rank0.pt: missing"):
        checkpoint.find_resume(str(folder), run_dir)
    with pytest.raises(checkpoint.CheckpointError, match="step_remainder_rank0.pt: missing"):
        load_remainder(folder, 0, torch.device("cpu"))
    (folder / REMAINDER.format(rank=0)).write_bytes(b"not a torch file")  # read past the manifest
    with pytest.raises(checkpoint.CheckpointError, match="step_remainder_rank0.pt: unreadable"):
        load_remainder(folder, 0, torch.device("cpu"))


def test_a_stop_inside_a_distribution_distillation_step_resumes_exactly(tmp_path, monkeypatch, uninterrupted):
    """distill.form=distribution carries the teacher's head states in the batch: they travel in the step's
    rest (a NamedTuple of tensors, rebuilt on load), so the resumed passes equal the uninterrupted ones."""
    teacher = write_tiny_teacher(tmp_path / "teacher")
    args = [*ARGS, "distill=teacher", f"distill.teacher.path={teacher}", "distill.form=distribution"]
    run_dir = tmp_path / "run"
    assert stopped_at(monkeypatch, run_dir, 9, args) == EXIT_PREEMPTED
    folder = run_dir / INSIDE_STEP_2.format(k=1)
    rest = load_remainder(folder, 0, torch.device("cpu"))
    assert rest.batch.teacher_states is not None and rest.batch.teacher_states.hidden.dim() == 3
    assert exit_code([*args, "resume=auto"], run_dir) == 0
    assert_equals_uninterrupted(run_dir, uninterrupted(args))
