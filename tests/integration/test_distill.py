"""On-policy distillation in real runs of the tiny model (docs/algorithm.md): a teacher equal to the
student moves nothing (also with LoRA, rollout=async and a tool environment), a run with a teacher resumes
bit for bit, distill.form=distribution trains on both forwards and with distill=self, and a teacher of
another vocabulary or chat template stops the command with exit 2 naming both models, as the removed
distill.form=loss and distill.kl_estimator do naming what replaced them. (Two ZeRO-2 ranks:
tests/integration/test_distributed.py.)"""

import json

import pytest
import torch
from safetensors.torch import load_file

import grpo_run.trainer as trainer
from grpo_run import metrics as M
from grpo_run.models.tiny import ensure_tiny_model
from tests.builders import LEARN, QUIET, config, exit_code, whole_and_resumed, write_tiny_teacher
from tests.helpers import FAST, read_metrics, run_cli


def without_timings(rows: list[dict]) -> list[dict]:
    return [
        {k: v for k, v in r.items() if not k.startswith("perf/") and k != M.DISTILL_TEACHER_S} for r in rows
    ]


def test_a_teacher_equal_to_the_student_moves_nothing_and_distill_none_logs_nothing(tmp_path, _cache_dir):
    tiny = ensure_tiny_model(_cache_dir)
    args = [*FAST, *QUIET, "trainer.lr=1e-2", "distill=teacher", f"distill.teacher.path={tiny}"]
    trainer.train(config(args, tmp_path / "same"))
    rows = read_metrics(tmp_path / "same")
    assert [(r[M.DISTILL_TEACHER_KL], r[M.UPDATE_NORM]) for r in rows] == [(0.0, 0.0), (0.0, 0.0)]
    assert all(r[M.DISTILL_TEACHER_S] > 0 for r in rows)
    start, end = (
        load_file(tiny / "model.safetensors"),
        load_file(tmp_path / "same" / "final" / "model.safetensors"),
    )
    assert all(torch.equal(start[k], end[k]) for k in start)
    trainer.train(config([*FAST, *QUIET, "trainer.max_steps=1"], tmp_path / "none"))
    (row,) = read_metrics(tmp_path / "none")
    assert not [k for k in row if k.startswith("distill/")]


@pytest.mark.parametrize(
    "extra",
    [["lora=default"], ["rollout=async"], ["env=calculator", "generation.max_new_tokens=16"]],
    ids=["lora", "async", "environment"],
)
def test_a_teacher_equal_to_the_student_moves_nothing_with_lora_async_and_tools(tmp_path, _cache_dir, extra):
    """The student's side of the teacher term is the policy as it trains: with LoRA (the adapter starts
    at zero, so base + adapter is the teacher), one step behind its sampler (rollout=async) and over
    multi-turn episodes (tool tokens are outside the loss), a teacher equal to it still gives exactly 0."""
    tiny = ensure_tiny_model(_cache_dir)
    args = [*FAST, *QUIET, "trainer.lr=1e-2", "distill=teacher", f"distill.teacher.path={tiny}", *extra]
    trainer.train(config(args, tmp_path / "run"))
    rows = read_metrics(tmp_path / "run")
    assert [(r[M.DISTILL_TEACHER_KL], r[M.UPDATE_NORM]) for r in rows] == [(0.0, 0.0), (0.0, 0.0)]


def test_resume_mid_run_with_a_teacher_is_bitwise_identical(tmp_path):
    teacher = write_tiny_teacher(tmp_path / "teacher", seed=1)
    args = [*LEARN, "distill=teacher", f"distill.teacher.path={teacher}"]
    args += ["distill.reward_weight=0.5", "distill.discount=0.5"]
    whole, resumed = whole_and_resumed(args, tmp_path)
    assert [r["step"] for r in read_metrics(resumed)] == [3, 4]
    assert without_timings(read_metrics(resumed)) == without_timings(read_metrics(whole))[2:]
    assert all(r[M.DISTILL_TEACHER_KL] != 0 for r in read_metrics(whole))
    a = load_file(whole / "final" / "model.safetensors")
    b = load_file(resumed / "final" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_teacher_of_another_vocabulary_exits_2_naming_both_models(tmp_path, capsys):
    teacher = write_tiny_teacher(tmp_path / "other", vocab_size=400)
    args = [*FAST, *QUIET, "distill=teacher", f"distill.teacher.path={teacher}"]
    assert exit_code(args, tmp_path / "run") == 2
    err = capsys.readouterr().err
    assert f"distill.teacher.path='{teacher}'" in err and "(model=tiny)" in err, err


@pytest.mark.parametrize("backend", ["native", "plain"])
def test_distribution_form_trains_towards_another_teacher_and_equal_gives_zero(tmp_path, _cache_dir, backend):
    """distill.form=distribution through the command on the tiny model, on both training forwards: with
    another teacher the divergence is positive and the weights move; with a teacher equal to the student
    the divergence is 0 to the rounding of two passes, and the task reward is weighted by 0."""
    teacher = write_tiny_teacher(tmp_path / "teacher", seed=1)
    args = [
        *FAST,
        *QUIET,
        "trainer.lr=1e-2",
        "distill=teacher",
        "distill.form=distribution",
        f"backend={backend}",
    ]
    trainer.train(config([*args, f"distill.teacher.path={teacher}"], tmp_path / "other"))
    rows = read_metrics(tmp_path / "other")
    assert all(r[M.DISTILL_DIVERGENCE] > 0 and r[M.UPDATE_NORM] > 0 for r in rows)
    assert all(r[M.DISTILL_TEACHER_KL] >= 0 for r in rows) and any(
        r[M.DISTILL_TEACHER_LOGRATIO] for r in rows
    )
    trainer.train(config([*args, f"distill.teacher.path={ensure_tiny_model(_cache_dir)}"], tmp_path / "same"))
    rows = read_metrics(tmp_path / "same")
    assert rows[0][M.DISTILL_DIVERGENCE] == pytest.approx(0.0, abs=1e-6)
    assert rows[0][M.DISTILL_TEACHER_KL] == 0.0


def test_distribution_form_with_self_distillation_runs(tmp_path):
    """distill=self: the teacher is the policy with the answer in its prompt, its head a snapshot."""
    args = [*FAST, *QUIET, "distill=self", "distill.form=distribution", "distill.jsd_beta=0.5"]
    trainer.train(config(args, tmp_path / "run"))
    rows = read_metrics(tmp_path / "run")
    assert all(r[M.DISTILL_DIVERGENCE] > 0 for r in rows)


def test_a_teacher_with_another_chat_template_exits_2_unless_allowed(tmp_path, capsys):
    teacher = write_tiny_teacher(tmp_path / "teacher", seed=1)
    cfg_path = teacher / "tokenizer_config.json"
    cfg_path.write_text(json.dumps({**json.loads(cfg_path.read_text()), "chat_template": "{{ messages }}"}))
    (teacher / "chat_template.jinja").unlink(missing_ok=True)
    args = [*FAST, *QUIET, "trainer.max_steps=1", "distill=teacher", f"distill.teacher.path={teacher}"]
    assert exit_code(args, tmp_path / "refused") == 2
    err = capsys.readouterr().err
    assert f"distill.teacher.path='{teacher}': its chat template" in err and "(model=tiny)" in err, err
    assert exit_code([*args, "distill.teacher.allow_template_mismatch=true"], tmp_path / "allowed") == 0
    warned = [line for line in capsys.readouterr().err.splitlines() if "allow_template_mismatch" in line]
    assert len(warned) == 1 and warned[0].startswith("warning: "), warned


@pytest.mark.parametrize(
    "override,said",
    [
        ("distill.form=loss", "distill.form=loss (a k1/k3 estimate"),
        ("distill.kl_estimator=k3", "distill.kl_estimator was removed"),
        ("+distill.kl_estimator=k1", "distill.kl_estimator was removed"),
    ],
)
def test_removed_distillation_names_exit_2_saying_what_replaced_them(tmp_path, override, said):
    proc, _ = run_cli([*FAST, "distill=self", override], tmp_path, check=False)
    assert proc.returncode == 2, proc.stderr
    assert said in proc.stderr and "distill.form=distribution" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
