"""A stop ends a native prefill between layers (grpo_run/native/decoder.py): the prefill of one large
evaluation batch may take seconds per call on a CPU, and the default run's step-0 evaluation must stop
within seconds. A user's forward hook asks for the stop while a layer runs, as a signal would."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from grpo_run.native.decoder import NativeDecoder
from grpo_run.safety import stop
from tests.native.builders import SMALL, build, left_padded


def prefill(model, decoder: NativeDecoder) -> torch.Tensor:
    ids, mask = left_padded()
    return decoder.prefill(ids, mask, (mask.cumsum(1) - 1).clamp(min=0))


@torch.no_grad()
def test_a_stop_during_a_layer_ends_the_prefill_before_the_next_layer():
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**{**SMALL, "num_hidden_layers": 4})).eval()
    layers = model.model.layers
    ids, _ = left_padded()
    decoder = NativeDecoder(model, ids.size(1) + 4)
    hook = layers[1].mlp.down_proj.register_forward_hook(lambda *_: stop.request_stop())
    try:
        logits = prefill(model, decoder)
    finally:
        hook.remove()
    assert len(decoder.keys) == 2  # layers 0 and 1 ran; none after the stop
    assert logits.shape == (ids.size(0), model.config.vocab_size)  # cut short, shaped as ever


@torch.no_grad()
def test_without_a_stop_every_layer_runs_and_a_decode_step_is_never_cut():
    model = build("llama")
    ids, mask = left_padded()
    decoder = NativeDecoder(model, ids.size(1) + 4)
    prefill(model, decoder)
    assert len(decoder.keys) == len(model.model.layers)
    stop.request_stop()  # a decode step is one column: short, and the decode loop checks between steps
    tok = torch.zeros(ids.size(0), dtype=torch.long)
    attn = torch.cat([mask, mask.new_ones(ids.size(0), 1)], dim=1)
    decoder.step(tok, attn, (mask.sum(1, keepdim=True)))
    assert decoder.length == ids.size(1) + 1
