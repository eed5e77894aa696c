"""Packed against padded, forward by forward: the same per-token log-probs, entropies and gradients on
llama, qwen2 and qwen3, through the native layers (with and without shared prompts and the fused head)
and transformers' forward, with LoRA, with gradient checkpointing, in float32 and under bf16 autocast."""

import pytest
import torch
from peft import LoraConfig, get_peft_model

from grpo_run.models.forward import TransformersForward, trim_columns
from grpo_run.native.forward import NativeForward
from tests.native.builders import build
from tests.packing.batches import spread_rows

CPU = torch.device("cpu")
# (per-token values, gradients against each parameter's largest). float32: the same arithmetic on other
# matmul shapes (measured over every case here: log-probs 4.8e-7, entropies 1.4e-6, gradients 7.5e-7 of
# the largest); bf16 autocast rounds every matmul's output to 8 bits of mantissa on differently grouped
# sums (measured: log-probs 1.5e-3, entropies 7.3e-5, gradients 1.7e-2 of the largest).
TOL = {False: (1e-5, 1e-5), True: (1e-2, 5e-2)}


def forward_of(kind: str, *, share: bool = False, fused: bool = False, autocast: bool = False):
    common = dict(temperature=0.7, chunk_size=3, autocast_bf16=autocast, device=CPU)
    if kind == "hf":
        return TransformersForward(**common)
    return NativeForward(
        **common,
        choice="native",
        share_prompts=share,
        cast_weights_once=False,
        fused_head=fused,
        release_free_memory=False,
        trim_every_layers=0,
    )


def both_ways(forward, model, rows, *, entropy_grad: bool = False):
    """(log-probs, entropy, grads) packed and padded, each after a backward of a loss of both signs."""
    prompt_ids, prompt_mask, completion_ids, completion_mask = rows
    out = []
    for packed in (True, False):
        model.zero_grad(set_to_none=True)
        if packed:
            lp, ent = forward.packed_logprobs(model, *rows, with_entropy=True, entropy_grad=entropy_grad)
        else:
            p, pm, c, _ = trim_columns(*rows)
            lp, ent = forward.logprobs(model, p, pm, c, with_entropy=True, entropy_grad=entropy_grad)
        weights = torch.linspace(-1.0, 1.0, lp.numel()).view_as(lp) * completion_mask[:, : lp.size(1)]
        loss = (lp * weights).sum() + (ent * weights).sum() if entropy_grad else (lp * weights).sum()
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        out.append((lp.detach(), ent.detach(), grads))
    return out, completion_mask.bool()


def assert_same(packed, padded, mask, tolerances):
    (lp_a, ent_a, g_a), (lp_b, ent_b, g_b) = packed, padded
    tol, grad_tol = tolerances
    assert lp_a.shape == lp_b.shape
    assert (lp_a - lp_b)[mask].abs().max() <= tol
    assert (ent_a - ent_b)[mask].abs().max() <= tol
    assert g_a.keys() == g_b.keys() and g_a
    for name, want in g_b.items():
        assert (g_a[name] - want).abs().max() <= grad_tol * max(want.abs().max(), 1e-3), name


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize(
    "kind,share,fused",
    [("native", False, False), ("native", True, False), ("native", True, True), ("hf", False, False)],
    ids=["native", "native-shared", "native-shared-fused", "hf"],
)
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16"])
def test_packed_equals_padded(arch, kind, share, fused, autocast):
    model = build(arch).train()
    forward = forward_of(kind, share=share, fused=fused, autocast=autocast)
    (packed, padded), mask = both_ways(forward, model, spread_rows())
    assert_same(packed, padded, mask, TOL[autocast])


@pytest.mark.parametrize("kind", ["native", "hf"])
def test_packed_equals_padded_with_an_entropy_gradient(kind):
    model = build("llama").train()
    (packed, padded), mask = both_ways(forward_of(kind), model, spread_rows(), entropy_grad=True)
    assert_same(packed, padded, mask, TOL[False])


@pytest.mark.parametrize("kind", ["native", "hf"])
def test_packed_equals_padded_with_lora(kind):
    torch.manual_seed(1)
    peft = get_peft_model(
        build("llama"), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    )
    model = peft.get_base_model().train()  # as the run trains it (models.lora.LoraPolicy.model)
    for name, p in model.named_parameters():  # B starts at zero: give the adapter something to say
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)
    (packed, padded), mask = both_ways(forward_of(kind, share=True), model, spread_rows())
    assert any("lora_A" in n for n in packed[2])
    assert_same(packed, padded, mask, TOL[False])


@pytest.mark.parametrize("kind", ["native", "hf"])
def test_packed_equals_padded_with_gradient_checkpointing(kind):
    model = build("qwen2")
    model.gradient_checkpointing_enable()
    model.train()
    (packed, padded), mask = both_ways(forward_of(kind, share=True), model, spread_rows())
    assert_same(packed, padded, mask, TOL[False])
