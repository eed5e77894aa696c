"""Distillation's guards: a teacher whose EOS id or chat template differs from the policy's exits 2 naming
both (a warning line with distill.teacher.allow_template_mismatch=true); distill=self's {answer} on
records without a gold answer is a config error when the data loads, naming both keys; the removed
distill.form=loss and distill.kl_estimator say what replaced them."""

import re

import pytest

from grpo_run.config import ConfigError
from grpo_run.config.checks.distill import check_teacher_context
from grpo_run.config.removed import removed_hint
from grpo_run.models.teacher import teacher_model_config, template_mismatch
from grpo_run.models.tiny import build_tokenizer
from tests.builders import compose_config

FILE = ["data=jsonl", "data.train_path=train.jsonl", "eval.every_steps=0"]  # nothing is read at the door
NO_GOLD = [*FILE, "data.answer_field=null"]


def mismatch(teacher, allow=False):
    cfg = compose_config(["model=tiny", "distill=teacher", "distill.teacher.path=org/teacher"])
    theirs = teacher_model_config(cfg.model, cfg.distill)
    return template_mismatch(
        build_tokenizer(), teacher, student_model=cfg.model, teacher_model=theirs, allow=allow
    )


def test_a_teacher_with_another_eos_id_exits_2_naming_both():
    teacher = build_tokenizer()
    teacher.eos_token = teacher.convert_ids_to_tokens(5)
    with pytest.raises(ConfigError) as info:
        mismatch(teacher)
    said = str(info.value)
    assert said.startswith("distill.teacher.path='org/teacher': its EOS id 5") and "(model=tiny)" in said
    assert f"policy's {build_tokenizer().eos_token_id}" in said
    assert "distill.teacher.allow_template_mismatch=true" in said


def test_a_teacher_with_another_chat_template_exits_2_unless_allowed_with_one_warning_line():
    teacher = build_tokenizer()
    teacher.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(ConfigError, match=r"chat template different from the policy's \(model=tiny\)"):
        mismatch(teacher)
    warning = mismatch(teacher, allow=True)
    assert warning.startswith("warning: distill.teacher.path='org/teacher'") and "\n" not in warning
    assert mismatch(build_tokenizer()) is None  # the same tokenizer: nothing to say


def test_teacher_context_with_answer_and_no_gold_answers_names_both_keys():
    cfg = compose_config(["distill=self", *NO_GOLD])
    said = "distill.teacher_context='{prompt}\\n\\nA correct final answer is {answer}.': cannot be combined "
    said += "with data.answer_field=None"
    with pytest.raises(ConfigError, match=re.escape(said)):
        check_teacher_context(cfg, answered=False)
    check_teacher_context(cfg, answered=True)  # null read an `answer` column


@pytest.mark.parametrize(
    "overrides",
    [
        ["distill=self", *NO_GOLD, "distill.teacher_context='{prompt} Think twice.'"],  # no {answer}
        ["distill=self", "data=arithmetic", "data.answer_field=null"],  # generated: always answered
        ["distill=teacher", "distill.teacher.path=org/teacher", *NO_GOLD],  # a teacher reads no context
    ],
)
def test_contexts_and_sources_that_need_no_answer_column_pass(overrides):
    check_teacher_context(compose_config(overrides), answered=False)


@pytest.mark.parametrize(
    "override,said",
    [
        ("distill.form=loss", "distill.form=loss (a k1/k3 estimate"),
        ("distill.kl_estimator=k3", "distill.kl_estimator was removed"),
    ],
)
def test_removed_names_say_what_replaced_them(override, said):
    key, _, value = override.partition("=")
    hint = removed_hint(key, value)
    assert hint.startswith(said) and "distill.form=distribution" in hint
    assert removed_hint("distill.form", "advantage") == "" and removed_hint("distill.coef") == ""
