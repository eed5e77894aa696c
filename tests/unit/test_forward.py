"""Trimming padding columns before a forward pass changes no log-prob and no loss."""

import torch
from transformers import AutoModelForCausalLM

from grpo_run.algo import policy_loss
from grpo_run.models.forward import completion_logprobs, trim_columns
from grpo_run.models.tiny import ensure_tiny_model


def test_trimmed_forward_gives_the_same_logprobs_and_loss(_cache_dir):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(ensure_tiny_model(_cache_dir)).eval()
    pad = 0
    # Two extra all-padding prompt columns on the left, three extra padding columns on the right.
    prompt_ids = torch.tensor([[pad, pad, pad, 11, 12, 13], [pad, pad, 21, 22, 23, 24]])
    prompt_mask = (prompt_ids != pad).long()
    completion_ids = torch.tensor([[31, 32, 33, pad, pad, pad], [41, 42, pad, pad, pad, pad]])
    completion_mask = torch.tensor([[1, 1, 1, 0, 0, 0], [1, 1, 0, 0, 0, 0]])

    full, _ = completion_logprobs(
        model, prompt_ids, prompt_mask, completion_ids, temperature=0.7, chunk_size=3
    )
    p, pm, c, cm = trim_columns(prompt_ids, prompt_mask, completion_ids, completion_mask)
    assert p.shape == (2, 4) and c.shape == (2, 3)  # 2 prompt and 3 completion columns dropped
    trimmed, _ = completion_logprobs(model, p, pm, c, temperature=0.7, chunk_size=3)
    kept = completion_mask[:, :3].bool()
    assert torch.allclose(full[:, :3][kept], trimmed[kept], atol=1e-6)

    adv = torch.tensor([0.5, -1.0])
    kwargs = dict(epsilon=0.2, epsilon_high=0.2, beta=0.0, aggregation="per_token")
    loss_full = policy_loss(full, full.detach() + 0.1, None, adv, completion_mask, **kwargs).loss
    loss_trim = policy_loss(trimmed, trimmed.detach() + 0.1, None, adv, cm, **kwargs).loss
    assert torch.allclose(loss_full, loss_trim, atol=1e-6)
