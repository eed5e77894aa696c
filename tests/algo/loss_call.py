"""`policy_loss` called with one flat set of keywords: those naming a `LossSettings` field build the
settings, those naming a `LossInputs` field (entropy, token_weights, behaviour_logprobs) join the batch,
the rest (beta, normalizer, entropy_coef) pass through."""

from dataclasses import fields

from grpo_run.algo import LossInputs, LossSettings, policy_loss

SETTINGS = {f.name for f in fields(LossSettings)}
INPUTS = set(LossInputs._fields)


def loss_with(logprobs, old_logprobs, ref_logprobs, advantages, mask, **kw):
    settings = LossSettings(**{k: v for k, v in kw.items() if k in SETTINGS})
    tensors = {k: v for k, v in kw.items() if k in INPUTS}
    rest = {k: v for k, v in kw.items() if k not in SETTINGS and k not in INPUTS}
    x = LossInputs(logprobs, old_logprobs, advantages, mask, ref_logprobs=ref_logprobs, **tensors)
    return policy_loss(x, settings, **rest)
