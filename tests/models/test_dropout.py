"""Dropout in RL (grpo_run/models/dropout.py): `model.disable_dropout` zeroes every rate, LoRA's
included, and a pass without gradient never draws a dropout mask, so two passes agree bit for bit and a
teacher that sees what the student sees scores exactly what the student does."""

import pytest
import torch

from grpo_run import metrics as M
from grpo_run.backend import training_forward
from grpo_run.config.schema import LoraConfig
from grpo_run.models import lora
from grpo_run.models.dropout import disable_dropout, eval_mode
from grpo_run.passes import frozen_logprobs, logprobs_for
from grpo_run.rollout.generate import Rollout
from tests.builders import compose_config
from tests.helpers import FAST, read_metrics, run_cli
from tests.native.builders import VOCAB, build


def dropped_lora(p: float = 0.5) -> torch.nn.Module:
    model = build("qwen2")
    cfg = LoraConfig(enabled=True, r=4, alpha=8.0, dropout=p)
    policy = lora.wrap(model, cfg, lora.resolve_targets(lora.adaptable_linear_names(model), ["all-linear"]))
    with torch.no_grad():  # a non-zero adapter, so its (dropped) input changes the output
        for name, param in policy.model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.3, generator=torch.Generator().manual_seed(len(name)))
    return policy.model.train()


def rollout() -> Rollout:
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, VOCAB, (4, 6), generator=g)
    completion = torch.randint(3, VOCAB, (4, 5), generator=g)
    return Rollout(
        prompt_ids=prompt,
        prompt_mask=torch.ones_like(prompt),
        completion_ids=completion,
        completion_mask=torch.ones_like(completion),
        truncated=torch.zeros(4, dtype=torch.bool),
    )


def forward_of(backend: str):
    return training_forward(compose_config(["model=tiny", f"backend={backend}"]), torch.device("cpu"))


@pytest.mark.parametrize("backend", ["plain", "native"])
def test_two_passes_without_gradient_are_equal_bit_for_bit_with_lora_dropout(backend):
    forward = forward_of(backend)
    model, batch = dropped_lora(0.5), rollout()
    # The check has teeth: in train mode two forwards over the same weights differ (dropout's masks).
    with torch.no_grad():
        a = logprobs_for(forward, model, batch, slice(0, 4), with_entropy=False)[0]
        b = logprobs_for(forward, model, batch, slice(0, 4), with_entropy=False)[0]
    assert not torch.equal(a, b)
    first = frozen_logprobs(batch, forward=forward, model=model, micro_batch_size=2)
    second = frozen_logprobs(batch, forward=forward, model=model, micro_batch_size=4)
    assert torch.equal(first, second)
    assert model.training  # the pass restored the train mode the update needs


def test_disable_dropout_zeroes_lora_and_attention_rates_and_keeps_the_config():
    model = dropped_lora(0.5)
    for module in model.modules():  # an attention module's own rate, as transformers keeps it
        if hasattr(module, "attention_dropout"):
            module.attention_dropout = 0.1
    zeroed = disable_dropout(model)
    assert any("lora_dropout" in name for name in zeroed) and any("attention_dropout" in n for n in zeroed)
    rates = [m.p for m in model.modules() if isinstance(m, torch.nn.Dropout)]
    assert rates and all(p == 0.0 for p in rates)
    assert all(getattr(m, "attention_dropout", 0.0) == 0.0 for m in model.modules())
    assert model.config.attention_dropout == 0.0  # the model's own config: what final/ saves is untouched
    batch, fwd = rollout(), forward_of("plain")
    with torch.no_grad():  # in train mode now, and deterministic
        a = logprobs_for(fwd, model, batch, slice(0, 4), with_entropy=False)[0]
        b = logprobs_for(fwd, model, batch, slice(0, 4), with_entropy=False)[0]
    assert torch.equal(a, b)
    assert disable_dropout(model) == []  # nothing left to zero


def test_eval_mode_restores_the_state_it_found():
    model = build("qwen2").eval()
    with eval_mode(model):
        assert not model.training
    assert not model.training
    model.train()
    with eval_mode(model):
        assert not model.training
    assert model.training


@pytest.mark.parametrize("disable", ["true", "false"])
def test_self_distillation_from_the_students_own_context_gives_teacher_kl_0(tmp_path, disable):
    args = [
        *FAST,
        "logger=console",
        "logger.console=false",
        "distill=self",
        "distill.teacher_context='{prompt}'",  # the teacher sees exactly the student's prompt
        "distill.reward_weight=1.0",  # the task reward moves the adapter, so its dropout matters from step 2
        "trainer.max_steps=3",
        "lora=default",
        "lora.r=4",
        "lora.dropout=0.5",
        "lora.lr=3e-2",
        f"model.disable_dropout={disable}",
    ]
    proc, run_dir = run_cli(args, tmp_path)
    if disable == "true":
        assert "dropout: off (model.disable_dropout=true" in proc.stderr
        assert "lora.dropout=0.5 is not applied" in proc.stderr
    else:
        assert "dropout: on in the update's forward (model.disable_dropout=false)" in proc.stderr
    rows = read_metrics(run_dir)
    assert len(rows) == 3 and all(row[M.DISTILL_TEACHER_KL] == 0.0 for row in rows), rows
