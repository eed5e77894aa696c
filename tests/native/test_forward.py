"""Trimming padding columns before a forward pass changes no log-prob and no loss; the LM head runs on
the T predicting columns only, with the log-probs of the whole last T + 1 columns sliced."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from grpo_run.algo import token_logprobs_and_entropy
from grpo_run.models.forward import trim_columns
from grpo_run.models.tiny import ensure_tiny_model
from grpo_run.native.forward import NativeSettings, native_completion_logprobs
from grpo_run.native.layers import native_logits
from tests.algo.loss_call import loss_with


def test_trimmed_forward_gives_the_same_logprobs_and_loss(_cache_dir):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(ensure_tiny_model(_cache_dir)).eval()
    pad = 0
    # Two extra all-padding prompt columns on the left, three extra padding columns on the right.
    prompt_ids = torch.tensor([[pad, pad, pad, 11, 12, 13], [pad, pad, 21, 22, 23, 24]])
    prompt_mask = (prompt_ids != pad).long()
    completion_ids = torch.tensor([[31, 32, 33, pad, pad, pad], [41, 42, pad, pad, pad, pad]])
    completion_mask = torch.tensor([[1, 1, 1, 0, 0, 0], [1, 1, 0, 0, 0, 0]])

    settings = NativeSettings(0.7, 3)
    full, _ = native_completion_logprobs(model, prompt_ids, prompt_mask, completion_ids, settings=settings)
    p, pm, c, cm = trim_columns(prompt_ids, prompt_mask, completion_ids, completion_mask)
    assert p.shape == (2, 4) and c.shape == (2, 3)  # 2 prompt and 3 completion columns dropped
    trimmed, _ = native_completion_logprobs(model, p, pm, c, settings=settings)
    kept = completion_mask[:, :3].bool()
    assert torch.allclose(full[:, :3][kept], trimmed[kept], atol=1e-6)

    adv = torch.tensor([0.5, -1.0])
    kwargs = dict(epsilon=0.2, epsilon_high=0.2, beta=0.0, aggregation="per_token")
    loss_full = loss_with(full, full.detach() + 0.1, None, adv, completion_mask, **kwargs).loss
    loss_trim = loss_with(trimmed, trimmed.detach() + 0.1, None, adv, cm, **kwargs).loss
    assert torch.allclose(loss_full, loss_trim, atol=1e-6)


@pytest.mark.parametrize("backend", ["native", "hf"])
@pytest.mark.parametrize("autocast", [False, True])
def test_head_on_the_predicting_columns_equals_slicing_the_last_t_plus_1(_cache_dir, backend, autocast):
    # native_completion_logprobs sends only the T columns that predict completion tokens through the LM head;
    # the plain version computes the last T + 1 columns' logits and drops the last one. The same
    # log-probs and entropies bit for bit; the gradients to rounding (a norm weight's gradient is a sum
    # over one row fewer, its zero term gone, which regroups the float additions).
    model = AutoModelForCausalLM.from_pretrained(ensure_tiny_model(_cache_dir)).train()
    g = torch.Generator().manual_seed(0)
    prompt_ids = torch.randint(3, 200, (3, 7), generator=g)
    prompt_mask = torch.ones_like(prompt_ids)
    prompt_mask[1, :2] = 0
    completion_ids = torch.randint(3, 200, (3, 5), generator=g)

    def run(fn):
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logprobs, entropy = fn()
        logprobs.sum().backward()
        return logprobs.detach(), entropy, [p.grad.clone() for p in model.parameters()]

    def plain():
        ids = torch.cat([prompt_ids, completion_ids], dim=1)
        mask = torch.cat([prompt_mask, torch.ones_like(completion_ids)], dim=1)
        pos = (mask.cumsum(dim=1) - 1).clamp(min=0)
        if backend == "native":
            logits = native_logits(model, ids, mask, pos, 6)
        else:
            logits = model(input_ids=ids, attention_mask=mask, position_ids=pos, logits_to_keep=6).logits
        return token_logprobs_and_entropy(logits[:, :-1], completion_ids, 0.7, 4)

    ours = run(
        lambda: native_completion_logprobs(
            model,
            prompt_ids,
            prompt_mask,
            completion_ids,
            settings=NativeSettings(0.7, 4, backend=backend),
            with_entropy=True,
        )
    )
    ref = run(plain)
    assert torch.equal(ours[0], ref[0]) and torch.equal(ours[1], ref[1])
    for a, b in zip(ours[2], ref[2]):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize(
    "native,plain,protocol,methods",
    [
        (
            "NativeForward",
            "TransformersForward",
            "TrainingForward",
            ("logprobs", "optimizer_step", "release_memory"),
        ),
        ("NativeEngine", "TransformersEngine", "GenerationEngine", ("generate", "policy_updated", "close")),
    ],
)
def test_the_fast_path_implements_the_protocols_without_extending_the_plain_classes(
    native, plain, protocol, methods
):
    # A batch's trip goes one way: native/ calls shared helpers of models/ and rollout/, never back up a
    # class hierarchy into the plain implementation and down again.
    import grpo_run.models.forward as plain_forward
    import grpo_run.native.forward as native_forward
    import grpo_run.native.generation as native_engine
    import grpo_run.rollout.engines as plain_engines

    modules = {"NativeForward": native_forward, "NativeEngine": native_engine}
    plains = {"TransformersForward": plain_forward, "TransformersEngine": plain_engines}
    cls, base = getattr(modules[native], native), getattr(plains[plain], plain)
    assert base not in cls.__mro__
    declared = getattr(plains[plain], protocol)
    for name in methods:
        assert name in vars(declared) and name in vars(cls), name
