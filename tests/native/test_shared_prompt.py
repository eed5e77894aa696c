"""The shared-prompt training forward (native/shared_prompt.py) against the plain native forward over
the concatenated rows: the same logits and gradients to float32 rounding, with left padding of
different lengths, groups interleaved in the micro-batch, both attentions, all three architectures,
with and without gradient checkpointing; nothing shared -> the plain forward runs."""

import pytest
import torch

from grpo_run.models.loading import enable_checkpointing
from grpo_run.native.forward import NativeSettings, native_completion_logprobs
from grpo_run.native.shared_prompt import distinct_prompts, shared_prompt_logits
from tests.native.builders import ROW_PROMPT, VOCAB, build, micro_batch, plain_logits


# Rows 0..6 from three prompts, interleaved: prompt 0 four times, 1 twice, 2 once.
def logits_and_grads(model, fn, *inputs):
    model.zero_grad()
    logits = fn(model, *inputs)
    weights = torch.randn(logits.shape, generator=torch.Generator().manual_seed(3))
    (logits * weights).sum().backward()
    return logits.detach(), [p.grad.clone() for p in model.parameters()]


def test_distinct_prompts_by_ids_and_mask():
    ids = torch.tensor([[0, 5, 6], [0, 5, 6], [7, 5, 6], [0, 5, 6]])
    mask = torch.tensor([[0, 1, 1], [0, 1, 1], [1, 1, 1], [1, 1, 1]])  # row 3: same ids, a real 0 token
    u_ids, u_mask, inverse = distinct_prompts(ids, mask)
    assert u_ids.shape == (3, 3)
    assert torch.equal(u_ids[inverse], ids) and torch.equal(u_mask[inverse], mask)
    assert inverse[0] == inverse[1] and len({int(inverse[0]), int(inverse[2]), int(inverse[3])}) == 3


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_shared_prompt_logits_and_gradients_equal_the_plain_forward(arch, attn):
    model = build(arch).train()
    model.config._attn_implementation = attn
    batch = micro_batch()
    plain, plain_grads = logits_and_grads(model, plain_logits, *batch)
    shared, shared_grads = logits_and_grads(model, shared_prompt_logits, *batch)
    assert shared.shape == plain.shape == (len(ROW_PROMPT), 5, VOCAB)
    torch.testing.assert_close(shared, plain, atol=1e-5, rtol=1e-5)
    # A prompt's gradient is the sum over its rows, added once instead of in G separate rows.
    for a, b in zip(shared_grads, plain_grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("autocast", [False, True])
def test_checkpointing_the_shared_forward_gives_the_same_gradients(autocast):
    model = build("qwen2").train()
    batch = micro_batch()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        _, plain = logits_and_grads(model, shared_prompt_logits, *batch)
        enable_checkpointing(model)
        _, ckpt = logits_and_grads(model, shared_prompt_logits, *batch)
    for a, b in zip(plain, ckpt):
        assert torch.equal(a, b)


def test_completion_logprobs_share_prompts_or_fall_back():
    model = build("llama").eval()
    prompt_ids, prompt_mask, completion_ids = micro_batch(t=1)  # a single completion token too
    plain_kw = dict(settings=NativeSettings(0.7, 4, backend="native"), with_entropy=True)
    kw = dict(plain_kw, settings=NativeSettings(0.7, 4, backend="native", share_prompts=True))
    shared = native_completion_logprobs(model, prompt_ids, prompt_mask, completion_ids, **kw)
    plain = native_completion_logprobs(model, prompt_ids, prompt_mask, completion_ids, **plain_kw)
    for a, b in zip(shared, plain):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a, _ = native_completion_logprobs(model, prompt_ids, prompt_mask, completion_ids, **kw)
        b, _ = native_completion_logprobs(model, prompt_ids, prompt_mask, completion_ids, **plain_kw)
    assert (a - b).abs().max() < 5e-2  # bf16 rounds matmuls of other shapes differently
    # Every row its own prompt: nothing to share, and the plain forward runs.
    distinct = prompt_ids[[0, 1, 3]], prompt_mask[[0, 1, 3]], completion_ids[[0, 1, 3]]
    assert shared_prompt_logits(model, *distinct) is None
