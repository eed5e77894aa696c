"""distill=teacher | self (docs/algorithm.md, "On-policy distillation"): its knobs and the combinations the
per-token advantage cannot take. The teacher's tokenizer is checked against the policy's when it loads
(`models/teacher.py`)."""

import math
import re

from grpo_run.algo import LOSS_ESTIMATORS, DistillForm
from grpo_run.config.checks.base import check, refuse
from grpo_run.config.checks.model import check_model_path
from grpo_run.config.schema import Config, DistillKind

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
    if d.form == DistillForm.LOSS:
        estimators = " or ".join(e.value for e in LOSS_ESTIMATORS)
        check(
            d.kl_estimator in LOSS_ESTIMATORS,
            "distill.kl_estimator",
            d.kl_estimator.value,
            f"must be {estimators} (a reverse-KL estimate from the student's own samples)",
        )
    refuse(
        d.form == DistillForm.LOSS and d.discount != 0,
        "distill.discount",
        d.discount,
        "distill.form",
        d.form.value,
        "the discount sums later tokens' teacher terms into the advantage; the loss form has none",
    )
    refuse(
        d.form == DistillForm.ADVANTAGE and cfg.grpo.off_policy_mask_threshold is not None,
        "grpo.off_policy_mask_threshold",
        cfg.grpo.off_policy_mask_threshold,
        "distill.form",
        d.form.value,
        "the off-policy mask drops whole completions by the sign of their advantage, which distillation "
        "makes per token; use distill.form=loss",
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
