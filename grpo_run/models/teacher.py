"""distill=teacher: the teacher's model settings and the check that it reads the policy's tokens."""

from dataclasses import replace

from transformers import PreTrainedTokenizerBase

from grpo_run.config.checks.base import ConfigError
from grpo_run.config.schema import DistillConfig, ModelConfig, ModelKind


def teacher_model_config(model: ModelConfig, distill: DistillConfig) -> ModelConfig:
    """The teacher's ModelConfig: `distill.teacher.path`, loaded like the policy (its dtype, autocast,
    attention and trust_remote_code unless distill.teacher sets them); never trained, so no checkpointing."""
    t = distill.teacher
    return replace(
        model,
        kind=ModelKind.PRETRAINED,
        path=t.path,
        dtype=model.dtype if t.dtype is None else t.dtype,
        gradient_checkpointing=False,
        trust_remote_code=model.trust_remote_code if t.trust_remote_code is None else t.trust_remote_code,
    )


def model_name(model: ModelConfig) -> str:
    """How a model is named in a message: its path, or its built-in kind."""
    return model.path if model.kind == ModelKind.PRETRAINED and model.path else f"model={model.kind.value}"


def check_same_tokenizer(
    student: PreTrainedTokenizerBase,
    teacher: PreTrainedTokenizerBase,
    *,
    student_model: ModelConfig,
    teacher_model: ModelConfig,
) -> None:
    """The teacher scores the student's token ids, so both must map text to the same ids: the same
    vocabulary (a family's models differ only in how far their embeddings are padded, which never
    matters here). A ConfigError (exit 2) naming both models otherwise."""
    ours, theirs = student.get_vocab(), teacher.get_vocab()
    if ours == theirs:
        return
    only_ours = len(set(ours.items()) - set(theirs.items()))
    raise ConfigError(
        f"distill.teacher.path={teacher_model.path!r}: its tokenizer differs from the policy's "
        f"({model_name(student_model)}): {len(theirs)} tokens against {len(ours)}, {only_ours} of the "
        "policy's tokens missing or with another id; the teacher must share the policy's tokenizer "
        "(a model of the same family)"
    )


def template_mismatch(
    student: PreTrainedTokenizerBase,
    teacher: PreTrainedTokenizerBase,
    *,
    student_model: ModelConfig,
    teacher_model: ModelConfig,
    allow: bool,
) -> str | None:
    """The teacher must end a turn where the policy does and lay out a chat as it does: otherwise it
    scores the student's tokens as text formatted for another model (its end-of-turn token mid-sequence,
    another turn structure). A ConfigError (exit 2) naming both models and what differs; with `allow`
    (distill.teacher.allow_template_mismatch) the one warning line to print instead, None when they agree."""
    differs = []
    if student.eos_token_id != teacher.eos_token_id:
        differs.append(
            f"EOS id {teacher.eos_token_id} ({teacher.eos_token!r}) against the policy's "
            f"{student.eos_token_id} ({student.eos_token!r})"
        )
    if (student.chat_template or None) != (teacher.chat_template or None):
        differs.append(
            "chat template " + ("none" if not teacher.chat_template else "different") + " from the policy's"
        )
    if not differs:
        return None
    said = (
        f"distill.teacher.path={teacher_model.path!r}: its {' and '.join(differs)} "
        f"({model_name(student_model)})"
    )
    if allow:
        return f"warning: {said}; going on (distill.teacher.allow_template_mismatch=true)"
    raise ConfigError(
        f"{said}; the teacher would score the student's tokens as text laid out for another model; use a "
        "teacher of the policy's family and chat format, or set distill.teacher.allow_template_mismatch=true"
    )
