"""On-policy distillation's teachers (grpo_run/teacher.py) on the tiny model: self-distillation's
teacher sees the privileged context and the student does not; a teacher that sees what the student sees
scores its tokens exactly as the student's own pass; the tokenizer check names both models."""

import pytest
import torch

from grpo_run.backend import training_forward
from grpo_run.config import ConfigError
from grpo_run.data import Example
from grpo_run.data.prompts import TeacherContextError, encode_prompts, teacher_messages
from grpo_run.models.loading import load_model, load_tokenizer
from grpo_run.models.teacher import check_same_tokenizer, teacher_model_config
from grpo_run.passes import frozen_logprobs
from grpo_run.rollout.engines import TransformersEngine
from grpo_run.rollout.groups import generate
from grpo_run.teacher import FrozenTeacher, SelfTeacher
from tests.builders import compose_config, write_tiny_teacher

G = 2
EXAMPLES = [
    Example("What is 12 + 30?", "42", "a", columns={"hint": "add the tens first"}),
    Example("What is 5 + 6?", "11", "b", columns={"hint": "count on"}),
]


@pytest.fixture(scope="module")
def run():
    cfg = compose_config(["model=tiny", "distill=self", f"grpo.group_size={G}", "trainer.micro_batch_size=2"])
    device = torch.device("cpu")
    tokenizer = load_tokenizer(cfg.model)
    policy = load_model(cfg.model, device, trainable=False)
    forward = training_forward(cfg, device)
    return cfg, tokenizer, policy, forward, device


def rollout_of(run):
    cfg, tokenizer, policy, _, device = run
    engine = TransformersEngine(
        policy, eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id, autocast_bf16=False
    )
    return generate(
        engine,
        tokenizer,
        EXAMPLES,
        [1, 2],
        data=cfg.data,
        sampling=cfg.generation,
        group_size=G,
        device=device,
    )


def self_teacher(run, context: str) -> SelfTeacher:
    cfg, tokenizer, policy, forward, _ = run
    return SelfTeacher(
        policy, forward, tokenizer, data=cfg.data, context=context, group_size=G, micro_batch_size=2
    )


def test_the_teachers_prompt_holds_the_privileged_context_and_the_students_does_not(run):
    cfg, tokenizer, *_ = run
    context = "{prompt}\nThe answer is {answer}; hint: {hint}."
    ids, mask = self_teacher(run, context).prompts(EXAMPLES, torch.device("cpu"))
    teacher_texts = tokenizer.batch_decode(ids, skip_special_tokens=True)
    student_ids, _ = encode_prompts(tokenizer, cfg.data, EXAMPLES, torch.device("cpu"))
    student_texts = tokenizer.batch_decode(student_ids, skip_special_tokens=True)
    assert ids.shape[0] == len(EXAMPLES) * G  # each group's prompt for each of its G rows
    for i, ex in enumerate(EXAMPLES):
        for text in teacher_texts[i * G : (i + 1) * G]:
            assert "What is" in text and f"The answer is {ex.answer}; hint: {ex.columns['hint']}." in text
        assert ex.question in student_texts[i]
        assert ex.answer not in student_texts[i] and "hint" not in student_texts[i]


def test_a_placeholder_no_record_fills_is_a_config_error_naming_the_key(run):
    cfg, *_ = run
    with pytest.raises(TeacherContextError, match=r"distill.teacher_context=.*\{solution\}.*hint") as info:
        teacher_messages(cfg.data, EXAMPLES[0], "{prompt} {solution}")
    assert isinstance(info.value, ConfigError)  # exit 2


def test_a_teacher_seeing_the_students_prompt_scores_its_tokens_as_the_student(run):
    """Self-distillation with the context {prompt}, and a frozen teacher with the policy's weights: the
    teacher's log-probs are the student's own pass, bit for bit (distill/teacher_kl exactly 0)."""
    cfg, _, policy, forward, device = run
    rollout = rollout_of(run)
    student = frozen_logprobs(rollout, forward=forward, model=policy, micro_batch_size=2)
    assert torch.equal(self_teacher(run, "{prompt}").logprobs(rollout, EXAMPLES), student)
    assert torch.equal(FrozenTeacher(policy, forward, device, 2).logprobs(rollout, EXAMPLES), student)
    # with the answer in its prompt the same weights score the same tokens otherwise
    taught = self_teacher(run, "{prompt} The answer is {answer}.").logprobs(rollout, EXAMPLES)
    on = rollout.completion_mask.bool()
    assert not torch.equal(taught[on], student[on])


def teacher_tokenizer(folder):
    cfg = compose_config(["model=tiny", "distill=teacher", f"distill.teacher.path={folder}"])
    model_cfg = teacher_model_config(cfg.model, cfg.distill)
    return load_tokenizer(model_cfg), model_cfg


def test_a_teacher_with_another_tokenizer_is_refused_naming_both_models(run, tmp_path):
    cfg, tokenizer, *_ = run
    other, other_cfg = teacher_tokenizer(write_tiny_teacher(tmp_path / "other", vocab_size=400))
    with pytest.raises(
        ConfigError, match=rf"distill.teacher.path='{tmp_path}/other'.*policy's \(model=tiny\)"
    ):
        check_same_tokenizer(tokenizer, other, student_model=cfg.model, teacher_model=other_cfg)
    # other weights, the same tokenizer: accepted
    same, same_cfg = teacher_tokenizer(write_tiny_teacher(tmp_path / "same", seed=3))
    check_same_tokenizer(tokenizer, same, student_model=cfg.model, teacher_model=same_cfg)
