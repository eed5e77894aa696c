"""`TrainingForward.head_states` (distill.form=distribution): the native forward and transformers' give the
same log-probs as their `logprobs`, and the same head input and weight; the distributions the states make
are the model's own logits; gradients reach the model through the divergence on both paths, also with the
weights cast once under bf16 autocast and a tied head."""

import pytest
import torch

from grpo_run.algo import generalized_jsd
from grpo_run.models.forward import TransformersForward
from grpo_run.native.forward import NativeForward
from tests.native.builders import build, micro_batch, plain_logits


def forwards(**native):
    kwargs = dict(temperature=0.7, chunk_size=3, autocast_bf16=False, device=torch.device("cpu"))
    fast = dict(
        choice="native",
        share_prompts=True,
        cast_weights_once=False,
        fused_head=True,
        release_free_memory=False,
        trim_every_layers=0,
    )
    return TransformersForward(**kwargs), NativeForward(**kwargs, **{**fast, **native})


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_both_forwards_give_the_same_states_and_logprobs(arch):
    model = build(arch)
    p, pm, c = micro_batch()
    plain, native = forwards()
    for fwd in (plain, native):
        want, _ = fwd.logprobs(model, p, pm, c, with_entropy=False)
        lp, entropy, states = fwd.head_states(model, p, pm, c, with_entropy=True)
        torch.testing.assert_close(lp, want, rtol=1e-5, atol=1e-5)
        assert entropy is not None and states.hidden.shape == (*c.shape, 32) and states.temperature == 0.7
        logits = states.hidden @ states.weight.T  # the model's own logits at the predicting columns
        torch.testing.assert_close(logits, plain_logits(model, p, pm, c), rtol=1e-4, atol=1e-4)
    a = plain.head_states(model, p, pm, c, with_entropy=False)[2]
    b = native.head_states(model, p, pm, c, with_entropy=False)[2]
    torch.testing.assert_close(a.hidden, b.hidden, rtol=1e-4, atol=1e-5)
    assert a.weight is b.weight


@pytest.mark.parametrize("cast_weights_once", [False, True])
def test_the_divergence_gradient_reaches_the_model_on_both_forwards(cast_weights_once):
    """The tied llama head under bf16 autocast (its kept cast joined to the embedding's with casts):
    the two forwards' gradients of the divergence to another model agree to bf16 rounding."""
    p, pm, c = micro_batch()
    teacher = build("qwen2")
    grads = []
    for fwd in forwards(cast_weights_once=cast_weights_once):
        fwd.autocast_bf16 = True
        student = build("llama").train()
        with torch.no_grad():
            target = fwd.head_states(teacher, p, pm, c, with_entropy=False)[2]
        with fwd.optimizer_step(student, 1):
            lp, _, states = fwd.head_states(student, p, pm, c, with_entropy=False)
            (generalized_jsd(states, target, beta=1.0).sum() + 0 * lp.sum()).backward()
        grads.append({n: q.grad.clone() for n, q in student.named_parameters() if q.grad is not None})
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, rtol=0.1, atol=2e-3, msg=name)
        assert g.abs().sum() > 0, name
