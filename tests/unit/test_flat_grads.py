"""Contiguous gradients (trainer.contiguous_grads, engine/flat_grads.py): the update's gradients live in
one buffer and are autograd's own, bit for bit, through accumulation over micro-batches, clipping, weight
decay and AdamW; a parameter no backward reaches is left alone, as with autograd's own gradients."""

import torch
from transformers import AutoModelForCausalLM

from grpo_run.config.schema import LRScheduler
from grpo_run.engine import SingleProcessEngine
from grpo_run.engine.schedule import lr_factor
from grpo_run.models.tiny import ensure_tiny_model


def engine_for(model: torch.nn.Module, contiguous: bool) -> SingleProcessEngine:
    return SingleProcessEngine(
        model,
        lr=1e-2,
        weight_decay=0.1,
        betas=(0.9, 0.99),
        lr_factor=lr_factor(LRScheduler.LINEAR, warmup_steps=1, max_steps=5),
        max_grad_norm=1.0,
        device=torch.device("cpu"),
        fused_adamw=True,
        contiguous_grads=contiguous,
    )


def micro_batches():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 200, (3, 10), generator=g) for _ in range(2)]


def test_contiguous_grads_are_autograds_bit_for_bit(_cache_dir):
    folder = ensure_tiny_model(_cache_dir)
    models = [AutoModelForCausalLM.from_pretrained(folder) for _ in range(2)]
    engines = [engine_for(models[0], contiguous=False), engine_for(models[1], contiguous=True)]
    for _ in range(3):  # three optimizer steps of two micro-batches each
        grads, norms = [], []
        for model, engine in zip(models, engines):
            for ids in micro_batches():
                engine.backward(model(input_ids=ids, labels=ids).loss)
            grads.append([p.grad.clone() for p in model.parameters()])
            norms.append(engine.step())
        assert all(torch.equal(a, b) for a, b in zip(*grads))
        assert torch.equal(norms[0], norms[1])
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        assert torch.equal(a, b)


def test_the_gradients_live_in_one_buffer_until_the_step(_cache_dir):
    model = AutoModelForCausalLM.from_pretrained(ensure_tiny_model(_cache_dir))
    engine = engine_for(model, contiguous=True)
    for ids in micro_batches():
        engine.backward(model(input_ids=ids, labels=ids).loss)
    buffer = engine._flat.buffer
    start, end = buffer.data_ptr(), buffer.data_ptr() + buffer.numel() * buffer.element_size()
    params = list(model.parameters())
    assert buffer.numel() == sum(p.numel() for p in params)
    assert all(start <= p.grad.data_ptr() < end for p in params)  # accumulated in place, twice
    engine.step()
    assert engine._flat.buffer is None and all(p.grad is None for p in params)


def test_a_parameter_no_backward_reaches_is_left_alone(_cache_dir):
    # An unused parameter keeps grad None: AdamW skips it (no weight decay, no state), as it would
    # without the buffer, instead of stepping it with a zero gradient.
    model = AutoModelForCausalLM.from_pretrained(ensure_tiny_model(_cache_dir))
    model.unused = torch.nn.Parameter(torch.ones(4))
    engine = engine_for(model, contiguous=True)
    ids = micro_batches()[0]
    engine.backward(model(input_ids=ids, labels=ids).loss)
    assert model.unused.grad is not None  # a zeroed view until the step looks
    engine.step()
    assert torch.equal(model.unused.detach(), torch.ones(4))
    assert model.unused not in engine.optimizer.state
