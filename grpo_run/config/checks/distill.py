"""distill=teacher | self (docs/algorithm.md, "On-policy distillation"): its knobs, the problems each
form's entry of `DISTILL_FORMS` finds, and the combinations distillation cannot take. The teacher's
tokenizer, EOS id and chat template are checked against the policy's when it loads (`models/teacher.py`),
and a teacher_context's {answer} against the data when the data loads (`check_teacher_context`)."""

import dataclasses
import math
import re
import string

from grpo_run.algo import form_problems
from grpo_run.config.checks.base import check, fail, refuse
from grpo_run.config.checks.model import check_model_path
from grpo_run.config.schema import GENERATED_SOURCES, Config, DistillConfig, DistillKind

# distill.teacher.device: null (the policy's), cpu, cuda or cuda:N.
TEACHER_DEVICE = re.compile(r"cpu|cuda(:\d+)?")


def validate_distill(cfg: Config) -> None:
    d = cfg.distill
    if d.kind == DistillKind.NONE:
        return
    check(d.coef > 0 and math.isfinite(d.coef), "distill.coef", d.coef, "must be a finite number > 0")
    check(0 <= d.discount <= 1, "distill.discount", d.discount, "must lie in [0, 1]")
    check(
        d.reward_weight >= 0 and math.isfinite(d.reward_weight),
        "distill.reward_weight",
        d.reward_weight,
        "must be a finite number >= 0 (0: pure distillation)",
    )
    validate_form(cfg)
    refuse(
        cfg.grpo.filter_zero_std and d.reward_weight == 0,
        "grpo.filter_zero_std",
        cfg.grpo.filter_zero_std,
        "distill.reward_weight",
        d.reward_weight,
        "with no task reward in the update, a group whose rewards are all equal still carries the "
        "teacher's signal, and dropping it (and sampling again) throws that away; set "
        "grpo.filter_zero_std=false, or distill.reward_weight > 0",
    )
    t = d.teacher
    if d.kind == DistillKind.TEACHER:
        check(
            bool(t.path), "distill.teacher.path", t.path, "distill=teacher needs a hub id or a model folder"
        )
        check_model_path("distill.teacher.path", t.path)
    else:
        for key, value in (("path", t.path), ("device", t.device), ("dtype", t.dtype)):
            refuse(
                value is not None,
                f"distill.teacher.{key}",
                value if not hasattr(value, "value") else value.value,
                "distill.kind",
                d.kind.value,
                "the teacher is the policy itself (no second model)",
            )
        check(
            bool(d.teacher_context.strip()), "distill.teacher_context", d.teacher_context, "must not be empty"
        )
    if t.device is not None:
        check(
            TEACHER_DEVICE.fullmatch(t.device) is not None,
            "distill.teacher.device",
            t.device,
            "must be null (the policy's device), cpu, cuda or cuda:N",
        )


def validate_form(cfg: Config) -> None:
    """distill.form and the knobs one form alone reads: the first problem its entry in DISTILL_FORMS finds."""
    d = cfg.distill
    knobs = {f.name: getattr(d, f.name) for f in dataclasses.fields(DistillConfig)}
    knobs["off_policy_mask_threshold"] = cfg.grpo.off_policy_mask_threshold
    defaults = {f.name: getattr(DistillConfig(), f.name) for f in dataclasses.fields(DistillConfig)}
    problem = next(form_problems(knobs, defaults), None)
    if problem is None:
        return
    if problem.other is None:
        fail(problem.key, problem.value, problem.why)
    refuse(True, problem.key, problem.value, problem.other, problem.other_value, problem.why)


def uses_answer(template: str) -> bool:
    """Whether a str.format template names the {answer} field."""
    return any(name == "answer" for _, name, _, _ in string.Formatter().parse(template) if name is not None)


def check_teacher_context(cfg: Config, *, answered: bool) -> None:
    """Once the data is loaded (`answered`: some training record has a gold answer): distill=self with a
    teacher_context naming {answer} on records without one would show the teacher an empty answer on
    every prompt, so it is refused naming both keys (as `reward.validate_gold_answers` refuses a
    gold-answer reward). The generated sources always carry their answers."""
    d = cfg.distill
    if d.kind != DistillKind.SELF or not uses_answer(d.teacher_context) or answered:
        return
    if cfg.data.source in GENERATED_SOURCES:
        return
    refuse(
        True,
        "distill.teacher_context",
        d.teacher_context,
        "data.answer_field",
        cfg.data.answer_field,
        "it shows the teacher each record's gold answer, and no training record has one (data.answer_field "
        "is null and the data has no `answer` column, or the column is empty); set data.answer_field to the "
        "column that holds it, or write a teacher_context without {answer}",
    )
