"""A frozen model that scores the policy's samples: loaded once, with its head, then called in batches.

Every model read and never trained beside the policy loads through `loading.pretrained` (one
foreign-code guard, one error message) and scores tokens through `models.forward.completion_logprobs`:
the reference and the teacher (`loading.load_model(..., trainable=False)`: they share the policy's
tokenizer and device, `passes.py` scores the sampled tokens) and, here, the reward models and
judges, which bring their own tokenizer and device. `load_frozen` takes what such a model needs
(`FrozenSpec`: path, dtype, device, trust_remote_code) and returns it in eval mode without gradients,
with its tokenizer. The batched calls below are
what the reward models and judges use (`grpo_run/scoring/model_reward.py`):

- `classifier_scores`: the head's first logit per text, right-padded as TRL pads its reward models; the
  head pools each row's last non-pad token, so a batch scores as its rows one at a time do.
- `answer_logprobs`: log P(answer | prompt) per row, through the training's own per-token log-prob forward
  (`grpo_run/models/forward.py`, temperature 1).
- `greedy_replies`: each prompt's greedy continuation, decoded.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from enum import StrEnum

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from grpo_run.config.schema import DType, ModelConfig
from grpo_run.models.forward import completion_logprobs
from grpo_run.models.loading import pretrained, resolve_model_path, tokenizer_at

# Rows of `answer_logprobs`' log-softmax taken at once (as backend.logprob_chunk_size does in training).
LOGPROB_CHUNK = 256


class Head(StrEnum):
    CAUSAL_LM = "causal_lm"
    SEQUENCE_CLASSIFIER = "sequence_classifier"


HEAD_CLASSES = {
    Head.CAUSAL_LM: AutoModelForCausalLM,
    Head.SEQUENCE_CLASSIFIER: AutoModelForSequenceClassification,
}


@dataclass(frozen=True)
class FrozenSpec:
    """Which frozen model and where: a folder or hub id, its dtype, its device (`auto`: this rank's GPU
    when CUDA is available, else the CPU; `cuda`: this rank's GPU; `cpu`, `cuda:N`), and whether the
    folder's own code may run."""

    path: str
    dtype: DType = DType.FLOAT32
    device: str = "cpu"
    trust_remote_code: bool = False

    @classmethod
    def of_model(cls, cfg: ModelConfig, device: str = "auto") -> FrozenSpec:
        """The spec of a `model`-group config (a teacher, a reference): its built-in kinds resolved."""
        return cls(resolve_model_path(cfg), cfg.dtype, device, cfg.trust_remote_code)


@dataclass
class Frozen:
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    device: torch.device


def frozen_device(name: str) -> torch.device:
    """`FrozenSpec.device` as a torch device; a GPU rank's own is cuda:LOCAL_RANK (torchrun sets it)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device(name)


def load_frozen(spec: FrozenSpec, head: Head) -> Frozen:
    """The model at `spec.path` with `head`, on its device, in eval mode, without gradients, and its
    tokenizer (with a pad token, which a classifier's config learns too: it pools the last non-pad one)."""
    tokenizer = tokenizer_at(spec.path, spec.trust_remote_code)
    model = pretrained(
        HEAD_CLASSES[head], spec.path, dtype=spec.dtype, trust_remote_code=spec.trust_remote_code
    )
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    device = frozen_device(spec.device)
    model.to(device)
    model.eval()
    model.requires_grad_(False)
    return Frozen(model, tokenizer, device)


@torch.inference_mode()
def classifier_scores(frozen: Frozen, texts: list[str], *, add_special_tokens: bool) -> list[float]:
    """The classifier's first logit for each text, one forward for the batch."""
    batch = frozen.tokenizer(
        texts,
        padding=True,
        padding_side="right",
        add_special_tokens=add_special_tokens,
        return_tensors="pt",
    ).to(frozen.device)
    logits = frozen.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return logits[:, 0].float().tolist()  # [n]


@torch.inference_mode()
def answer_logprobs(
    frozen: Frozen, prompts: list[str], answers: list[str], *, add_special_tokens: bool
) -> list[float]:
    """log P(answer | prompt) for each row: the sum of the answer tokens' log-probs, one forward.
    add_special_tokens: the tokenizer's own (a BOS) before each prompt, for a prompt not from a chat
    template (which writes its own)."""
    tokenizer = frozen.tokenizer
    prompt = tokenizer(
        prompts, padding=True, padding_side="left", add_special_tokens=add_special_tokens, return_tensors="pt"
    )
    answer = tokenizer(
        answers, padding=True, padding_side="right", add_special_tokens=False, return_tensors="pt"
    )
    logprobs, _ = completion_logprobs(
        frozen.model,
        prompt["input_ids"].to(frozen.device),  # [n, P]
        prompt["attention_mask"].to(frozen.device),  # [n, P]
        answer["input_ids"].to(frozen.device),  # [n, T]
        temperature=1.0,
        chunk_size=LOGPROB_CHUNK,
    )
    mask = answer["attention_mask"].to(frozen.device)  # [n, T]
    return (logprobs.float() * mask).sum(dim=1).tolist()  # [n]


@torch.inference_mode()
def greedy_replies(
    frozen: Frozen, prompts: list[str], *, max_new_tokens: int, add_special_tokens: bool
) -> list[str]:
    """Each prompt's greedy continuation of at most `max_new_tokens` tokens, decoded without specials."""
    tokenizer = frozen.tokenizer
    batch = tokenizer(
        prompts, padding=True, padding_side="left", add_special_tokens=add_special_tokens, return_tensors="pt"
    ).to(frozen.device)
    out = frozen.model.generate(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        do_sample=False,
        max_new_tokens=max_new_tokens,
        pad_token_id=tokenizer.pad_token_id,
    )  # [n, P + new]
    new = out[:, batch["input_ids"].size(1) :]
    return tokenizer.batch_decode(new, skip_special_tokens=True)
