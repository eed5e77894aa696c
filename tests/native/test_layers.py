"""The native training forward (native/layers.py) against transformers' forward: the same logits,
log-probs and gradients with left padding on llama, qwen2 (q/k/v biases) and qwen3 (per-head q/k
norms), with sdpa and eager attention; bf16 autocast close; unsupported models fall back or fail."""

import copy
import warnings

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from grpo_run.config.schema import ModelConfig, ModelKind
from grpo_run.models.loading import enable_checkpointing, load_model
from grpo_run.native.forward import NativeSettings, native_completion_logprobs
from grpo_run.native.layers import (
    LlamaLayers,
    native_hidden,
    native_logits,
    resolve_backend,
    run_layers,
    visible_keys,
)
from tests.native.builders import VOCAB, build, left_padded


def both_logits(model, keep: int = 4):
    ids, mask = left_padded(rows=3, width=9)
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    ours = native_logits(model, ids, mask, pos, keep)
    theirs = model(input_ids=ids, attention_mask=mask, position_ids=pos, logits_to_keep=keep).logits
    return ours, theirs


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_native_logits_and_gradients_equal_transformers(arch, attn):
    model = build(arch)
    model.config._attn_implementation = attn
    model.train()  # the update's mode (no dropout in these configs)
    ours, theirs = both_logits(model)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    # The same gradient on every parameter for the same (arbitrary) function of the logits.
    weights = torch.randn(ours.shape, generator=torch.Generator().manual_seed(3))
    grads = []
    for logits in (ours, theirs):
        model.zero_grad()
        (logits * weights).sum().backward(retain_graph=True)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) == len(list(model.parameters()))
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], atol=1e-5, rtol=1e-4, msg=name)


def test_rotary_by_roll_is_rotate_half_exactly():
    # rotate_half([a, b, c, d]) = [-c, -d, a, b]; roll by 2 gives [c, d, a, b] and sin' = [-s, -s, s, s],
    # so x*cos + roll(x)*sin' = x*cos + rotate_half(x)*sin with the same products: bit-for-bit equal.
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    model = build("llama")
    net = LlamaLayers(model)
    x = torch.randn(2, 5, model.config.hidden_size)
    pos = torch.arange(5).repeat(2, 1) + torch.tensor([[0], [3]])
    q, k = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 5, 8)
    cos, sin = model.model.rotary_emb(x, pos)
    ref_q, ref_k = apply_rotary_pos_emb(q, k, cos, sin)
    c, s = net.rotary(x, pos)  # [n, t, 1, d]
    roll = lambda t: t * c.transpose(1, 2) + torch.roll(t, 4, dims=-1) * s.transpose(1, 2)  # noqa: E731
    assert torch.equal(roll(q), ref_q) and torch.equal(roll(k), ref_k)


def test_visible_keys_causal_without_padding_keys():
    # Row 0 has one padding column: its query sees only itself; later queries never see column 0.
    ok = visible_keys(torch.tensor([[0, 1, 1]]))[0, 0]
    assert ok.tolist() == [[True, False, False], [False, True, False], [False, True, True]]


def test_completion_logprobs_equal_across_backends_and_autocast_close():
    model = build("qwen2")
    ids, mask = left_padded(rows=3, width=6)
    completion = torch.randint(2, VOCAB, (3, 4), generator=torch.Generator().manual_seed(5))
    native_s, hf_s = NativeSettings(0.7, 5, backend="native"), NativeSettings(0.7, 5, backend="hf")
    native = native_completion_logprobs(model, ids, mask, completion, settings=native_s, with_entropy=True)
    hf = native_completion_logprobs(model, ids, mask, completion, settings=hf_s, with_entropy=True)
    for a, b in zip(native, hf):  # log-probs and entropies
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a, _ = native_completion_logprobs(model, ids, mask, completion, settings=native_s, with_entropy=True)
        b, _ = native_completion_logprobs(model, ids, mask, completion, settings=hf_s, with_entropy=True)
    # Both round to bf16 around every matmul; log-probs here are O(4).
    assert (a - b).abs().max() < 5e-2


def test_unsupported_model_falls_back_or_names_the_key():
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=16, n_layer=1, n_head=2, n_positions=32))
    ids = torch.randint(2, VOCAB, (2, 3))
    lp, _ = native_completion_logprobs(gpt2, ids, torch.ones_like(ids), ids, settings=NativeSettings(1.0, 4))
    assert lp.shape == (2, 3)  # auto ran transformers' forward
    with pytest.raises(ValueError, match="backend.forward=hf"):
        resolve_backend(gpt2, "native", "backend.forward")
    flash = build("llama")
    flash.config._attn_implementation = "flash_attention_2"  # not installed here; only the name matters
    assert resolve_backend(flash, "auto", "backend.forward") == "hf"


@pytest.mark.parametrize("frozen_embedding", [False, True])
@pytest.mark.parametrize("autocast", [False, True])
def test_gradient_checkpointing_is_honoured_with_the_same_gradients(autocast, frozen_embedding):
    # model.gradient_checkpointing: each layer saves only its input and recomputes in backward, as
    # transformers' layers do; the recomputation runs the same kernels on the same inputs (under the
    # same autocast), so the gradients are bit for bit the same. The reentrant form needs a layer input
    # that requires grad. transformers' switch makes the embedding's output require grad even when the
    # embedding is frozen; with the layers' flags set directly and a frozen embedding nothing does, and
    # the non-reentrant form runs instead (torch warns that the reentrant one leaves gradients None).
    def saved_and_grads(model):
        ids, mask = left_padded(rows=3, width=9)
        pos = (mask.cumsum(1) - 1).clamp(min=0)
        count = [0]

        def pack(t):
            count[0] += 1
            return t

        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                logits = native_logits(model, ids, mask, pos, 4)
        logits.float().square().sum().backward()
        return count[0], [None if p.grad is None else p.grad.clone() for p in model.parameters()]

    model = build("qwen2").train()
    model.model.embed_tokens.weight.requires_grad_(not frozen_embedding)
    plain_saved, plain = saved_and_grads(model)
    if frozen_embedding:
        for layer in model.model.layers:
            layer.gradient_checkpointing = True
    else:
        enable_checkpointing(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ckpt_saved, ckpt = saved_and_grads(model)
    assert not [w for w in caught if "requires_grad" in str(w.message)]
    assert ckpt_saved < plain_saved  # layer 0 keeps only its input; the last layer keeps its own
    assert sum(g is None for g in ckpt) == int(frozen_embedding)  # every layer weight has its gradient
    for a, b in zip(plain, ckpt):
        assert (a is None and b is None) or torch.equal(a, b)


def test_checkpointing_recomputes_every_layer_but_the_last():
    # The backward starts at the last layer: checkpointing it would recompute at once what its forward
    # had just computed, so it keeps its activations and runs once; the others run again in backward.
    model = build("llama").train()
    enable_checkpointing(model)
    model.config.num_hidden_layers = 3
    model.model.layers.append(copy.deepcopy(model.model.layers[-1]))
    net = LlamaLayers(model)
    calls = []

    def step(i, x, *args):
        calls.append(i)
        return net.layer(i, x, *args)

    ids, mask = left_padded(rows=3, width=9)
    x = net.embed(ids)
    cos, sin = net.rotary(x, (mask.cumsum(1) - 1).clamp(min=0))
    run_layers(net, step, x, cos, sin, visible_keys(mask)).sum().backward()
    assert sorted(calls) == [0, 0, 1, 1, 2]


def test_heap_trimmed_every_few_layers_in_the_forward_and_the_recomputation(monkeypatch):
    # trim_every=2 on three layers: the forward trims before layers 0 and 2, the backward's
    # recomputation (layers 1 and 0; the last layer is not checkpointed) before layer 0. Trimming moves
    # no live memory: the same gradients.
    import grpo_run.native.layers as native

    model = build("llama").train()
    enable_checkpointing(model)
    model.config.num_hidden_layers = 3
    model.model.layers.append(copy.deepcopy(model.model.layers[-1]))
    ids, mask = left_padded(rows=3, width=9)
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    trims = []
    monkeypatch.setattr(native, "release_free_memory", lambda min_free: trims.append(min_free) or True)
    monkeypatch.setattr(native, "TRIM_MIN_INPUT_BYTES", 0)  # this model's layer inputs are a few KB

    def grads(trim_every):
        model.zero_grad(set_to_none=True)
        x = native_hidden(LlamaLayers(model, trim_every=trim_every), ids, mask, pos)
        x.square().sum().backward()
        return [p.grad.clone() for p in model.parameters() if p.grad is not None]  # not the final norm

    plain = grads(0)
    assert trims == []
    trimmed = grads(2)
    assert trims == [native.MIN_FREE_BYTES] * 3
    assert all(torch.equal(a, b) for a, b in zip(plain, trimmed))
    with torch.no_grad():  # π_old / π_ref forwards: nothing to recompute, no trims
        native_hidden(LlamaLayers(model, trim_every=2), ids, mask, pos)
    assert len(trims) == 3
    monkeypatch.setattr(native, "TRIM_MIN_INPUT_BYTES", 2**20)  # layer inputs under 1 MB: no trims
    grads(2)
    assert len(trims) == 3


def test_model_gradient_checkpointing_switches_every_layer_on(_cache_dir):
    # model.gradient_checkpointing=true reaches each decoder layer's flag, which the native forward
    # reads, through transformers' current API (no deprecation warning); false leaves them off.
    for on in (True, False):
        cfg = ModelConfig(kind=ModelKind.TINY, gradient_checkpointing=on, cache_dir=str(_cache_dir))
        with warnings.catch_warnings():
            warnings.simplefilter("error", FutureWarning)
            model = load_model(cfg, torch.device("cpu"), trainable=True)
        assert [layer.gradient_checkpointing for layer in model.model.layers] == [on] * len(
            model.model.layers
        )


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tied_embedding_lookup_gradient_is_sparse_and_the_weight_gradient_dense(arch):
    model = build(arch).train()  # llama: a tied LM head; qwen2 here: untied
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    ids, mask = left_padded(rows=3, width=9)
    emb = LlamaLayers(model, head_follows=True).embed(ids)
    # A tied lookup's gradient is one row per token, added into the LM head's dense gradient; an
    # untied embedding keeps the dense gradient its optimizer needs, and so does a tied one whose head
    # the caller does not apply (nothing dense to add it into).
    assert emb.grad_fn._saved_sparse is tied
    assert LlamaLayers(model).embed(ids).grad_fn._saved_sparse is False
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    model.zero_grad(set_to_none=True)
    native_logits(model, ids, mask, pos, 4).logsumexp(-1).sum().backward()
    grad = model.get_input_embeddings().weight.grad
    assert grad.layout == torch.strided
    model.zero_grad(set_to_none=True)
    model(input_ids=ids, attention_mask=mask, position_ids=pos, logits_to_keep=4).logits.logsumexp(
        -1
    ).sum().backward()
    torch.testing.assert_close(grad, model.get_input_embeddings().weight.grad, atol=1e-6, rtol=1e-5)


def test_rotary_table_rows_are_the_rotary_embedding_of_their_positions():
    # The decoder looks cos and sin' up by position: the same bits as computing them for those positions.
    model = build("llama")
    net = LlamaLayers(model)
    x = torch.randn(2, 3, model.config.hidden_size)
    positions = torch.tensor([[0, 5, 17], [3, 4, 29]])
    cos, sin = net.rotary(x, positions)
    table = net.rotary_table(x, 30)
    assert torch.equal(table[0][positions], cos) and torch.equal(table[1][positions], sin)
    # A RoPE whose frequencies follow the longest position seen has no table: every step computes it.
    model.model.rotary_emb.rope_type = "dynamic"
    assert net.rotary_table(x, 30) is None


def test_eager_form_where_asked_and_on_cpu_in_half_precision():
    # sdpa unless the config says eager, except on CPU in bf16/fp16, where torch's sdpa is the slower;
    # in float32 the two forms give the same attention to rounding.
    model = build("llama")
    net = LlamaLayers(model)
    torch.manual_seed(0)
    q, k, v = torch.randn(3, 4, 5, 8), torch.randn(3, 2, 5, 8), torch.randn(3, 2, 5, 8)
    keys_ok = visible_keys(torch.ones(3, 5, dtype=torch.long))
    assert not net.use_eager(q) and net.use_eager(q.bfloat16()) and net.use_eager(q.half())
    sdpa = net.attention(0, q, k, v, keys_ok)
    net.eager = True
    assert net.use_eager(q)
    torch.testing.assert_close(net.attention(0, q, k, v, keys_ok), sdpa, atol=1e-6, rtol=1e-5)
