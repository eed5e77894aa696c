"""The fused AdamW kernel (trainer.fused_adamw, the default) takes the same steps as torch's plain
AdamW: same gradients in, the same weights out to float rounding, clipping and the LR schedule included."""

import torch
from transformers import AutoModelForCausalLM

from grpo_run.config.schema import LRScheduler
from grpo_run.engine import SingleProcessEngine
from grpo_run.engine.schedule import lr_factor
from grpo_run.models.tiny import ensure_tiny_model


def engine_for(model: torch.nn.Module, fused: bool) -> SingleProcessEngine:
    return SingleProcessEngine(
        model,
        lr=1e-2,
        weight_decay=0.1,
        betas=(0.9, 0.99),
        lr_factor=lr_factor(LRScheduler.LINEAR, warmup_steps=1, max_steps=5),
        max_grad_norm=1.0,
        device=torch.device("cpu"),
        fused_adamw=fused,
    )


def test_fused_adamw_takes_the_plain_steps(_cache_dir):
    folder = ensure_tiny_model(_cache_dir)
    models = [AutoModelForCausalLM.from_pretrained(folder) for _ in range(2)]
    engines = [engine_for(models[0], fused=False), engine_for(models[1], fused=True)]
    assert not engines[0].optimizer.param_groups[0]["fused"]
    assert engines[1].optimizer.param_groups[0]["fused"]
    ids = torch.randint(3, models[0].config.vocab_size, (4, 12), generator=torch.Generator().manual_seed(0))
    for _ in range(5):  # lr 1e-2 with weight decay: the weights move by ~1e-2 a step
        norms = []
        for model, engine in zip(models, engines):
            engine.backward(model(input_ids=ids, labels=ids).loss)
            norms.append(engine.step())
        torch.testing.assert_close(norms[0], norms[1], rtol=1e-5, atol=1e-6)
    moved = 0.0
    for (name, a), b, start in zip(
        models[0].named_parameters(),
        models[1].parameters(),
        AutoModelForCausalLM.from_pretrained(folder).parameters(),
    ):
        # Most tensors agree to ~1e-7. The k_proj biases get a gradient that is zero in exact arithmetic
        # (a shift of every key by the same vector cancels in the softmax), so their Adam steps
        # normalise rounding noise; there the two kernels differ by ~3e-6.
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5, msg=name)
        moved = max(moved, float((a - start).detach().abs().max()))
    assert moved > 1e-2  # the steps did move the weights
