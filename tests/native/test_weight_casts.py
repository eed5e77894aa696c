"""The update's weight casts (native/weight_casts.py): one bf16 cast per weight and optimizer step gives
the gradients autocast's cast at every use gives, bit for bit, over several micro-batches, with and
without gradient checkpointing, through the plain and the shared-prompt forward, on all three
architectures (a tied LM head included); outside autocast nothing changes."""

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from grpo_run.models.loading import enable_checkpointing
from grpo_run.native.forward import head_input, native_completion_logprobs
from grpo_run.native.fused_head import head_token_logprobs
from grpo_run.native.layers import LlamaLayers
from grpo_run.native.weight_casts import WeightCasts
from tests.native.builders import MICRO_BATCHES, SETTINGS, accumulated_grads, build, micro_batch


@pytest.mark.parametrize("fused_head", [False, True])
@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("share", [False, True])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_casting_once_gives_autocasts_gradients_bit_for_bit(arch, share, checkpointing, fused_head):
    # llama's LM head is tied to its embedding: with the fused head, the lookup and the head's cast
    # share one node (`WeightCasts.tied`), and the weight's gradient is still autocast's sum.
    model = build(arch).train()
    if checkpointing:
        enable_checkpointing(model)
    expected = accumulated_grads(model, None, share=share, fused_head=fused_head)
    casts = WeightCasts()
    got = accumulated_grads(model, casts, share=share, fused_head=fused_head)
    for name, grad in expected.items():
        assert got[name].dtype == torch.float32
        assert torch.equal(got[name], grad), name
    # 7 projections per layer (q, k, v, o, gate, up, down) and the LM head, each cast once for the
    # two micro-batches and (with checkpointing) the recomputations.
    layers = model.config.num_hidden_layers
    assert len(casts) == 7 * layers + 1


@pytest.mark.parametrize("checkpointing", [False, True])
def test_released_before_the_last_forward_the_same_gradients_and_the_casts_freed(checkpointing):
    model = build("llama").train()
    if checkpointing:
        enable_checkpointing(model)
    expected = accumulated_grads(model, WeightCasts(), share=True)
    casts = WeightCasts()
    got = accumulated_grads(model, casts, share=True, release=True)
    for name, grad in expected.items():
        assert torch.equal(got[name], grad), name
    # The last forward takes each kept cast out of the cache: none is left for the backward. Without
    # checkpointing the forward's graph holds them, and none is made twice: 7 per layer and the head.
    # A checkpointed layer's forward holds nothing, so its recomputation casts its 7 again (every layer
    # but the last, which keeps its activations: `run_layers`).
    assert len(casts) == 0
    layers = model.config.num_hidden_layers
    assert casts.made == 7 * layers + 1 + (7 * (layers - 1) if checkpointing else 0)


def test_released_before_a_single_micro_batch_nothing_is_kept():
    """An update in one micro-batch (the reference setting): the forward's casts are never cached."""
    model = build("llama").train()
    enable_checkpointing(model)
    prompt_ids, prompt_mask, completion_ids = micro_batch()
    casts = WeightCasts()
    casts.release_on_use()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lp, _ = native_completion_logprobs(
            model, prompt_ids, prompt_mask, completion_ids, settings=SETTINGS, weight_casts=casts
        )
        assert len(casts) == 0
    lp.sum().backward()
    assert len(casts) == 0 and all(p.grad is not None for p in model.parameters())


def test_a_tied_weight_waits_for_the_lookup_with_the_heads_gradient_in_bf16():
    torch.manual_seed(0)
    weight = torch.randn(6, 4, requires_grad=True)
    ids = torch.tensor([1, 3, 3])  # a repeated token: two rows of the lookup's gradient meet
    hidden = torch.randn(3, 4).bfloat16()

    def loss(for_lookup, for_head):
        lookup = torch.nn.functional.embedding(ids, for_lookup, sparse=True)  # [3, 4]
        return lookup.square().sum() + (hidden @ for_head.T).float().square().sum()

    for_lookup, for_head, _ = WeightCasts().tied(weight)
    assert for_head.dtype == torch.bfloat16 and torch.equal(for_lookup, weight)
    seen = []
    for_head.register_hook(lambda g: seen.append(g.dtype))  # what the node holds until the lookup's
    loss(for_lookup, for_head).backward()
    assert seen == [torch.bfloat16]
    # Autograd's own sum for a weight used twice (through autocast's cast): the same bits.
    plain = weight.detach().clone().requires_grad_(True)
    loss(plain, plain.to(torch.bfloat16)).backward()
    assert weight.grad.layout == torch.strided and weight.grad.dtype == torch.float32
    assert torch.equal(weight.grad, plain.grad)


def test_the_tied_heads_cast_is_freed_by_the_heads_backward_while_the_layers_live_on():
    # A checkpointed layer's recomputation keeps the LlamaLayers object alive to the end of the
    # backward; the tied head's bf16 cast must not ride along with it (57 MB on SmolLM2).
    model = build("llama").train()
    enable_checkpointing(model)
    prompt_ids, prompt_mask, completion_ids = micro_batch()
    casts = WeightCasts()
    casts.release_on_use()  # one micro-batch: nothing kept in the cache either
    net = LlamaLayers(model, casts, head_follows=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        hidden = head_input(net, prompt_ids, prompt_mask, completion_ids, share_prompts=True)
        weight, grads = net.head_weight()
        lp, _ = head_token_logprobs(
            hidden, weight, completion_ids, chunk_size=3, dtype=torch.bfloat16, weight_grad_blocks=grads
        )
    assert weight.dtype == torch.bfloat16 and net.tied_head_cast is None  # handed to the head once
    cast = StorageWeakRef(weight.untyped_storage())
    del weight, hidden
    lp.sum().backward()
    assert cast.expired()  # freed with the head's graph, `net` still referenced here
    assert net.model is model and model.model.embed_tokens.weight.grad is not None


@pytest.mark.parametrize("with_casts", [False, True])
def test_the_projections_keep_one_cast_of_their_shared_input(with_casts):
    # q, k, v read one norm's output, gate and up another: with the casts each is cast once
    # (`SharedCast`) and the projections keep that one copy; autocast casts at every use.
    model = build("llama").train()
    net = LlamaLayers(model, WeightCasts() if with_casts else None)
    x = torch.randn(2, 5, model.config.hidden_size, requires_grad=True)
    storages = {}

    def pack(t):
        if t.dtype == torch.bfloat16 and t.numel() == x.numel():  # a bf16 copy of the input (2-D views)
            storages[t.untyped_storage().data_ptr()] = t
        return t

    with (
        torch.autocast("cpu", dtype=torch.bfloat16),
        torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
    ):
        cos, sin = net.rotary(x, torch.arange(5).expand(2, 5))
        net.qkv(0, net.norm(x, net.layers[0].input_layernorm), cos, sin)
        qkv_copies = len(storages)
        net.mlp(0, x)
    assert (qkv_copies, len(storages) - qkv_copies) == ((1, 1) if with_casts else (3, 2))


def test_the_kept_casts_are_autocasts_rounding_of_the_weights():
    model = build("llama").train()
    casts = WeightCasts()
    weight = model.model.layers[0].mlp.up_proj.weight
    cast = casts(weight)
    assert cast.dtype == torch.bfloat16 and cast.requires_grad
    with torch.autocast("cpu", dtype=torch.bfloat16):
        x = torch.randn(3, weight.size(1))
        assert torch.equal(torch.nn.functional.linear(x, cast), model.model.layers[0].mlp.up_proj(x))
    assert casts(weight).data_ptr() == cast.data_ptr()  # the second use: the same tensor, no new cast


def test_outside_autocast_the_float32_weights_are_used():
    model = build("qwen2").train()
    casts = WeightCasts()
    plain = accumulated_grads(model, None, share=True, autocast=False)
    with_casts = accumulated_grads(model, casts, share=True, autocast=False)
    assert len(casts) == 0
    for name, grad in plain.items():
        assert torch.equal(with_casts[name], grad), name


def test_the_fused_heads_gradient_reaches_a_tied_weight_in_blocks_freed_one_by_one(monkeypatch):
    # With blocks of one vocabulary block each (the tiny model's 128 rows in many pieces), the tied
    # weight's node joins them into autocast's float32 sum bit for bit, freeing each as it goes.
    from grpo_run.native import fused_head

    monkeypatch.setattr(fused_head, "GRAD_BLOCK_BYTES", 1)
    model = build("llama").train()
    expected = accumulated_grads(model, None, share=True, fused_head=True)
    handed: list = []
    real_tied = WeightCasts.tied

    def spy(self, weight):
        lookup, cast, blocks = real_tied(self, weight)
        handed.append(blocks)
        return lookup, cast, blocks

    monkeypatch.setattr(WeightCasts, "tied", spy)
    got = accumulated_grads(model, WeightCasts(), share=True, fused_head=True)
    for name, grad in expected.items():
        assert torch.equal(got[name], grad), name
    assert len(handed) == len(MICRO_BATCHES) and all(blocks == [] for blocks in handed)  # all taken


def test_head_token_logprobs_hands_the_weights_gradient_over_in_row_blocks(monkeypatch):
    from grpo_run.native import fused_head

    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(2, 6, 8, generator=g)
    weight = torch.randn(40, 8, generator=g)
    targets = torch.randint(0, 40, (2, 6), generator=g)
    upstream = torch.randn(2, 6, generator=g)
    results = []
    for blocks in (None, []):
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        lp, _ = head_token_logprobs(
            h, w, targets, chunk_size=3, dtype=torch.bfloat16, weight_grad_blocks=blocks
        )
        lp.backward(upstream)
        results.append((lp.detach(), h.grad, w.grad, blocks))
    (lp0, h0, w0, _), (lp1, h1, w1, blocks) = results
    assert torch.equal(lp1, lp0) and torch.equal(h1, h0)
    assert w1 is None  # autograd saw no gradient for the weight: it is in the blocks
    # 12 rows, chunk 3: blocks of 3 * 40 // (2 * 12) = 5 vocabulary rows; GRAD_BLOCK_BYTES makes
    # each handed-over block a whole number of them, at least 8 MB (here: one block of all 40 rows).
    assert [r for r, _ in blocks] == [slice(0, 40)]
    assert blocks[0][1].dtype == torch.bfloat16 and torch.equal(blocks[0][1].float(), w0)
    monkeypatch.setattr(fused_head, "GRAD_BLOCK_BYTES", 1)
    blocks = []
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    head_token_logprobs(h, w, targets, chunk_size=3, dtype=torch.bfloat16, weight_grad_blocks=blocks)[
        0
    ].backward(upstream)
    assert [r for r, _ in blocks] == [slice(a, a + 5) for a in range(0, 40, 5)]
    assert torch.equal(torch.cat([b for _, b in blocks]).float(), w0)
