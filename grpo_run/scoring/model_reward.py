"""A reward entry that is a model: a sequence-classification reward model, or a generative judge.

    reward.functions=[{name: rm, model: {path: my-rm-folder}, weight: 1.0}, {name: math_verifier}]

The entry's callable (`ModelReward`) runs in a worker process of its own (`RewardEntry.own_worker`): the
model is loaded there once (`load`, off the budget clock) and kept, each call scores up to
`model.batch_size` completions in one forward under `reward.timeout_s`, and a call that hangs is abandoned
(its worker killed, the model loaded again by the next one) and counted as timeouts, one that raises
counted as errors; neither ends the run. The trainer's forward never sees the model.

What the model reads:
- classifier: the conversation (the prompt as the dataset gave it, a question as one user turn, then the
  completion as the assistant's turn) in the reward model's own chat template when its tokenizer has one,
  else the turns' texts joined by newlines; the score is the head's first logit (as TRL's reward models).
- judge: `kwargs.template` filled with the question, the gold answer ("" without one) and the completion,
  as one user turn in the judge's chat template (with the generation prompt) when it has one, else the
  text and a newline; then `verdict` (grpo_run/rewards/verdict.py): yes_prob or number.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from grpo_run.config.schema import RewardFunctionConfig, RewardModelKind
from grpo_run.models.frozen import (
    Frozen,
    FrozenSpec,
    Head,
    answer_logprobs,
    classifier_scores,
    greedy_replies,
    load_frozen,
)
from grpo_run.models.loading import ModelLoadError
from grpo_run.rewards.verdict import JUDGE_OPTIONS, Verdict, number_verdict, render, yes_probability
from grpo_run.scoring.registry import RewardEntry

HEADS = {RewardModelKind.CLASSIFIER: Head.SEQUENCE_CLASSIFIER, RewardModelKind.JUDGE: Head.CAUSAL_LM}

# Models loaded in this process, by (spec, head): a worker loads its entry's model once and keeps it.
_LOADED: dict[tuple[FrozenSpec, Head], Frozen] = {}


class ModelReward:
    """The picklable callable of a model entry: only the spec and options travel to the worker, which
    loads the model itself (`load`) and keeps it for every later call."""

    def __init__(
        self,
        spec: FrozenSpec,
        kind: RewardModelKind,
        options: Mapping[str, Any] | None = None,
        *,
        key: str = "reward model",
        threads: int | None = None,
    ) -> None:
        self.spec = spec
        self.kind = RewardModelKind(kind)
        self.options = {**JUDGE_OPTIONS, **(options or {})} if self.kind == RewardModelKind.JUDGE else {}
        self.key = key
        self.threads = threads

    def __repr__(self) -> str:
        return f"ModelReward({self.spec.path!r}, {self.kind.value})"

    def load(self) -> Frozen:
        """The model, loaded on first use in this process (the worker's preparation) and kept."""
        cache = (self.spec, HEADS[self.kind])
        if cache not in _LOADED:
            if self.threads is not None:
                torch.set_num_threads(self.threads)
            try:
                _LOADED[cache] = load_frozen(self.spec, HEADS[self.kind])
            except ModelLoadError as err:
                raise ModelLoadError(f"{self.key}: {err}") from None
        return _LOADED[cache]

    def prepare(self) -> None:
        """The worker's preparation before its first call (the pool runs it off the budget clock)."""
        self.load()

    def __call__(
        self, prompts: Sequence[Any], completions: Sequence[str], answers: Sequence[str], **batch: Any
    ) -> list[float | None]:
        """One value per completion; `batch` (the columns, completion ids, step) is not read."""
        frozen = self.load()
        if self.kind == RewardModelKind.CLASSIFIER:
            return self.classify(frozen, prompts, completions)
        return self.judge(frozen, prompts, completions, answers)

    def classify(self, frozen: Frozen, prompts: Sequence[Any], completions: Sequence[str]) -> list[float]:
        texts, templated = classifier_texts(frozen.tokenizer, prompts, completions)
        return classifier_scores(frozen, texts, add_special_tokens=not templated)

    def judge(
        self, frozen: Frozen, prompts: Sequence[Any], completions: Sequence[str], answers: Sequence[str]
    ) -> list[float | None]:
        o = self.options
        texts = [
            render(o["template"], question_of(p), answer or "", c)
            for p, c, answer in zip(prompts, completions, answers, strict=True)
        ]
        templated = bool(frozen.tokenizer.chat_template)
        if templated:
            texts = [
                frozen.tokenizer.apply_chat_template(
                    [{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True
                )
                for t in texts
            ]
        else:
            texts = [t + "\n" for t in texts]
        special = not templated
        if o["verdict"] == Verdict.NUMBER:
            replies = greedy_replies(
                frozen, texts, max_new_tokens=o["max_new_tokens"], add_special_tokens=special
            )
            return [number_verdict(reply) for reply in replies]
        n = len(texts)
        words = [o["yes_text"]] * n + ([o["no_text"]] * n if o["no_text"] is not None else [])
        logprobs = answer_logprobs(frozen, texts * (len(words) // n), words, add_special_tokens=special)
        no = logprobs[n:] if o["no_text"] is not None else [None] * n
        return [yes_probability(y, q) for y, q in zip(logprobs[:n], no, strict=True)]


def classifier_texts(
    tokenizer: PreTrainedTokenizerBase, prompts: Sequence[Any], completions: Sequence[str]
) -> tuple[list[str], bool]:
    """(the texts a classifier reads, whether its chat template wrote them): each conversation in the
    tokenizer's chat template when it has one, else its turns' texts joined by newlines. Training a
    reward model (scripts/train_reward_model.py) formats its examples with this too."""
    conversations = [conversation(p, c) for p, c in zip(prompts, completions, strict=True)]
    if tokenizer.chat_template:
        return [tokenizer.apply_chat_template(turns, tokenize=False) for turns in conversations], True
    return ["\n".join(turn["content"] for turn in turns) for turns in conversations], False


def conversation(prompt: Any, completion: str) -> list[dict[str, str]]:
    """The prompt's turns (a question: one user turn) and the completion as the assistant's."""
    turns = (
        [dict(m) for m in prompt]
        if isinstance(prompt, (list, tuple))
        else [{"role": "user", "content": prompt}]
    )
    return [*turns, {"role": "assistant", "content": completion}]


def question_of(prompt: Any) -> str:
    """A prompt's question: the text, or a conversation's last user turn."""
    if not isinstance(prompt, (list, tuple)):
        return str(prompt)
    users = [m["content"] for m in prompt if m.get("role") == "user"]
    return users[-1] if users else ""


def model_entry(fn: RewardFunctionConfig, key: str) -> RewardEntry:
    """The registry entry of a `model` reward (`key`: reward.functions[i], checked at the door)."""
    m = fn.model
    assert m is not None
    spec = FrozenSpec(m.path, m.dtype, m.device, m.trust_remote_code)
    reward = ModelReward(spec, m.kind, fn.kwargs, key=f"{key}.model.path", threads=m.threads)
    if fn.range is not None:
        low_high = (float(fn.range[0]), float(fn.range[1]))
    elif m.kind == RewardModelKind.JUDGE and reward.options["verdict"] == Verdict.YES_PROB:
        low_high = (0.0, 1.0)
    else:
        low_high = None  # a classifier's logit and a judge's number have no bounds of their own
    return RewardEntry(
        reward,
        range=None if low_high is None else (lambda _kwargs: low_high),
        isolated=True,
        # A call that raises or runs out of time says nothing about the completions: no score, rather
        # than a 0 that sits anywhere in a model's range (above every score of a negative-valued one).
        unscorable_on_failure=True,
        columns=True,
        preload=(__name__,),
        batch=m.batch_size,
        prepare=reward.prepare,
        own_worker=True,
    )
