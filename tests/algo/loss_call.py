"""`policy_loss` called with one flat set of keywords: those naming a `LossSettings` field build the
settings, the rest (beta, normalizer, entropy, entropy_coef, token_weights, ...) pass through."""

from dataclasses import fields

from grpo_run.algo import LossSettings, policy_loss

SETTINGS = {f.name for f in fields(LossSettings)}


def loss_with(logprobs, old_logprobs, ref_logprobs, advantages, mask, **kw):
    settings = LossSettings(**{k: v for k, v in kw.items() if k in SETTINGS})
    rest = {k: v for k, v in kw.items() if k not in SETTINGS}
    return policy_loss(logprobs, old_logprobs, ref_logprobs, advantages, mask, settings, **rest)
