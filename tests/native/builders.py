"""Small models and batches the fast path's tests share (built in code: no network)."""

from dataclasses import replace

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from grpo_run.native.forward import NativeSettings, native_completion_logprobs
from grpo_run.native.layers import native_logits

VOCAB = 64

SMALL = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    eos_token_id=1,
    pad_token_id=0,
    bos_token_id=None,
)


def build(arch: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if arch == "llama":  # tied embeddings, no bias, rope_theta 1e5 like SmolLM2
        model = LlamaForCausalLM(LlamaConfig(**SMALL, tie_word_embeddings=True, rope_theta=1e5))
    elif arch == "qwen2":  # q/k/v biases
        model = Qwen2ForCausalLM(Qwen2Config(**SMALL))
    else:  # qwen3: a head_dim of its own and per-head q/k RMSNorm
        model = Qwen3ForCausalLM(Qwen3Config(**SMALL, head_dim=16))
    return model.eval()


def left_padded(rows: int = 3, width: int = 7):
    """Token ids [rows, width] with 0, 2, 4 … padding columns on the left."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, VOCAB, (rows, width), generator=g)
    mask = torch.ones(rows, width, dtype=torch.long)
    for r in range(rows):
        mask[r, : min(2 * r, width - 1)] = 0
    return ids.masked_fill(mask == 0, 0), mask


ROW_PROMPT = torch.tensor([0, 1, 0, 2, 1, 0, 0])


def micro_batch(t: int = 5):
    g = torch.Generator().manual_seed(7)
    prompts = torch.randint(2, VOCAB, (3, 6), generator=g)  # [3, P]
    mask = torch.ones(3, 6, dtype=torch.long)
    mask[1, :2] = 0  # prompt 1 has 2 padding columns, prompt 2 has 5 (one real token)
    mask[2, :5] = 0
    prompts = prompts.masked_fill(mask == 0, 0)
    completions = torch.randint(2, VOCAB, (len(ROW_PROMPT), t), generator=g)  # [n, T]
    return prompts[ROW_PROMPT], mask[ROW_PROMPT], completions


def plain_logits(model, prompt_ids, prompt_mask, completion_ids):
    """native_logits over the concatenated rows at the T predicting columns (native_completion_logprobs' way)."""
    ids = torch.cat([prompt_ids, completion_ids], dim=1)
    mask = torch.cat([prompt_mask, torch.ones_like(completion_ids)], dim=1)
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    t, length = completion_ids.size(1), ids.size(1)
    return native_logits(model, ids, mask, pos, torch.arange(length - t - 1, length - 1))


SETTINGS = NativeSettings(1.0, 3, backend="native")  # native_completion_logprobs of the casts tests
MICRO_BATCHES = (slice(0, 4), slice(4, 7))  # rows 0..6 of test_shared_prompt's micro_batch, in two


def accumulated_grads(
    model, casts, *, share: bool, autocast: bool = True, release: bool = False, fused_head: bool = False
):
    """The update's loop: log-probs of each micro-batch, a weighted sum, backward; grads accumulate.
    release: as `trainer.update`, the casts are released on use before the last forward."""
    prompt_ids, prompt_mask, completion_ids = micro_batch()
    model.zero_grad(set_to_none=True)
    for mb in MICRO_BATCHES:
        if release and mb is MICRO_BATCHES[-1]:
            casts.release_on_use()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            lp, _ = native_completion_logprobs(
                model,
                prompt_ids[mb],
                prompt_mask[mb],
                completion_ids[mb],
                settings=replace(SETTINGS, share_prompts=share, fused_head=fused_head),
                weight_casts=casts,
            )
        weights = torch.linspace(-1.0, 1.0, lp.numel()).view_as(lp)  # a loss with both signs
        (lp * weights).sum().backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}
