"""The native decoder (our attention over a preallocated KV cache) against transformers' own forward:
the same logits at every step with left padding, repeated and dropped rows, on the three supported
architectures, so the same samples; unsupported models fall back (auto) or fail naming the fix."""

import pytest
import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from grpo_run.native.decoder import NativeDecoder, native_decoder
from grpo_run.native.layers import native_unsupported_reason, resolve_backend
from grpo_run.rollout.decoders import HFDecoder
from grpo_run.rollout.generate import Decoding, SamplingParams, generate_group_completions
from tests.native.builders import SMALL, VOCAB, build, left_padded


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@torch.no_grad()
def test_native_logits_equal_transformers_at_every_step(arch):
    model = build(arch)
    ids, mask = left_padded()
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    steps = 5
    native, hf = NativeDecoder(model, ids.size(1) + steps), HFDecoder(model)
    a, b = native.prefill(ids, mask, pos), hf.prefill(ids, mask, pos)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    # transformers' cache holds the prompt: its forward took our cache argument (an unknown name is
    # swallowed by **kwargs, and every step would then see one token; seen with `cache=` on 5.17).
    assert hf.cache.get_seq_length() == ids.size(1)
    for d in (native, hf):  # 3 prompts × 2 rows, then rows 1, 2, 5 only (two finished rows dropped)
        d.repeat_rows(2)
    attn, next_pos = mask.repeat_interleave(2, 0), pos[:, -1:].repeat_interleave(2, 0) + 1
    tok = a.argmax(-1).repeat_interleave(2, 0)
    for step in range(steps - 1):
        if step == 2:
            keep = torch.tensor([1, 2, 5])
            native.keep_rows(keep), hf.keep_rows(keep)
            attn, next_pos, tok = attn[keep], next_pos[keep], tok[keep]
        attn = torch.cat([attn, torch.ones_like(attn[:, :1])], 1)
        a, b = native.step(tok, attn, next_pos), hf.step(tok, attn, next_pos)
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        tok, next_pos = (
            (a + torch.arange(a.size(0))[:, None]).argmax(-1),
            next_pos + 1,
        )  # rows write different tokens


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_native_samples_what_transformers_samples(arch):
    model = build(arch)
    ids, mask = left_padded(rows=4, width=6)
    params = SamplingParams(max_new_tokens=12, temperature=1.0)
    runs = [
        generate_group_completions(
            model,
            ids,
            mask,
            group_size=3,
            params=params,
            seeds=[5, 6, 7, 8],
            decoding=Decoding(1, 0, make_decoder=native_decoder(model, b)),
        )
        for b in ("native", "hf")
    ]
    assert torch.equal(runs[0].completion_ids, runs[1].completion_ids)
    assert torch.equal(runs[0].completion_mask, runs[1].completion_mask)


@torch.no_grad()
def test_native_under_bf16_autocast_gives_close_logits():
    model = build("llama")
    ids, mask = left_padded()
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    native = NativeDecoder(model, ids.size(1) + 1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a = native.prefill(ids, mask, pos).float()
        b = HFDecoder(model).prefill(ids, mask, pos).float()
    # Both round to bf16 around every matmul, in different places; logits here are O(0.5).
    assert (a - b).abs().max() < 2e-2


def test_backend_resolution_names_the_fix():
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=16, n_layer=1, n_head=2, n_positions=32))
    assert "gpt2" in native_unsupported_reason(gpt2)
    assert resolve_backend(gpt2, "auto", "backend.decoder") == "hf"
    with pytest.raises(ValueError, match="backend.decoder=hf"):
        resolve_backend(gpt2, "native", "backend.decoder")
    sliding = Qwen2ForCausalLM(
        Qwen2Config(**SMALL, use_sliding_window=True, sliding_window=4, max_window_layers=0)
    )
    assert "sliding" in native_unsupported_reason(sliding)
    assert resolve_backend(build("qwen3"), "auto", "backend.forward") == "native"
    assert resolve_backend(build("qwen2"), "hf", "backend.forward") == "hf"


def test_cache_argument_follows_the_forward_signature():
    import inspect

    from grpo_run.rollout.decoders import cache_argument

    model = build("qwen2")
    assert cache_argument(model) in inspect.signature(model.forward).parameters

    class BeforeTheRename(torch.nn.Module):  # transformers 5.17's forward signature, in short
        def forward(self, input_ids=None, past_key_values=None, use_cache=None, **kwargs): ...

    assert cache_argument(BeforeTheRename()) == "past_key_values"


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@torch.no_grad()
def test_packed_projections_give_the_unpacked_logits(arch):
    # A small model's decoder makes q/k/v and gate/up one matmul each (qwen3 keeps separate q/k/v for
    # its per-head norms); the products are the same dot products, the rotary the same per element.
    model = build(arch)
    ids, mask = left_padded()
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    packed, plain = NativeDecoder(model, ids.size(1) + 2), NativeDecoder(model, ids.size(1) + 2)
    plain.net.packs = None
    assert packed.net.packs is not None and len(packed.net.packs) == model.config.num_hidden_layers
    torch.testing.assert_close(
        packed.prefill(ids, mask, pos), plain.prefill(ids, mask, pos), atol=1e-6, rtol=1e-6
    )
    attn, tok = torch.cat([mask, torch.ones_like(mask[:, :1])], 1), torch.tensor([3, 4, 5])
    a, b = packed.step(tok, attn, pos[:, -1:] + 1), plain.step(tok, attn, pos[:, -1:] + 1)
    torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_projections_are_packed_only_small_and_plain():
    from grpo_run.native.layers import LlamaLayers

    model = build("llama")
    assert not LlamaLayers(model).pack_projections(max_bytes=1024)  # the copies would exceed the budget
    model.model.layers[1].mlp.up_proj.register_forward_hook(lambda *a: None)  # e.g. an adapter's hook
    net = LlamaLayers(model)
    assert not net.pack_projections() and net.packs is None
