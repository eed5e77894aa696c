"""The training forward with each distinct prompt computed once (native backend, Llama family).

A GRPO micro-batch holds G completions of the same prompt (or several such groups). Under causal
attention a prompt token's hidden states never depend on what follows, so the G copies of a prompt in
the plain forward compute the same numbers G times, and the backward does it again. Here every layer
runs its norms, projections and MLP over the distinct prompts' tokens and the completions' tokens only,
packed into one row ([1, u·P + n·T, hidden]: one matmul per projection, as in the plain forward); the
attention runs twice, the prompts over themselves and the completions over their prompt's keys and
values (gathered per row, so their gradients sum back onto the shared prompt) and their own. With
prompts of P tokens and completions of T, a micro-batch of n rows from u prompts computes u·P + n·T
token positions instead of n·(P + T).

The arithmetic of each token is the plain forward's; matmuls over other shapes round differently, so
log-probs agree to float32 rounding (`tests/native/test_shared_prompt.py`).
"""

from functools import partial
from typing import NamedTuple

import torch
from transformers import PreTrainedModel

from grpo_run.native.layers import LlamaLayers, run_layers, visible_keys
from grpo_run.native.weight_casts import WeightCasts


class Packing(NamedTuple):
    """Where the distinct prompts and the completions sit in the packed row."""

    inverse: torch.Tensor  # [n] each row's prompt among the u distinct ones
    prompts: int  # u
    prompt_len: int  # P
    rows: int  # n
    completion_len: int  # T

    def split(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[1, heads, u·P + n·T, d] -> prompts [u, heads, P, d], completions [n, heads, T, d] (views)."""
        cut = self.prompts * self.prompt_len
        prompts = t[0, :, :cut].unflatten(1, (self.prompts, self.prompt_len)).transpose(0, 1)
        completions = t[0, :, cut:].unflatten(1, (self.rows, self.completion_len)).transpose(0, 1)
        return prompts, completions


def distinct_prompts(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor):
    """(ids [u, P], mask [u, P], inverse [n]) of the distinct (ids, mask) rows of a micro-batch."""
    rows = torch.cat([prompt_ids, prompt_mask.to(prompt_ids.dtype)], dim=1)  # [n, 2P]
    unique, inverse = torch.unique(rows, dim=0, return_inverse=True)
    p = prompt_ids.size(1)
    return unique[:, :p], unique[:, p:].to(prompt_mask.dtype), inverse


def shared_prompt_logits(
    model: PreTrainedModel,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    casts: WeightCasts | None = None,
) -> torch.Tensor | None:
    """prompt [n, P] (left-padded) + completion [n, T] -> logits [n, T, V] of the T columns that
    predict the completion tokens: `native_logits` on the concatenated rows, each distinct prompt
    computed once; None when every row has its own prompt (nothing to share: the plain forward is
    cheaper). Gradient checkpointing per layer as in `native_logits` (`run_layers`); `casts` as there."""
    net = LlamaLayers(model, casts)
    hidden = shared_prompt_hidden(net, prompt_ids, prompt_mask, completion_ids)
    return None if hidden is None else net.head(hidden)  # [n, T, V]


def shared_prompt_hidden(
    net: LlamaLayers, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion_ids: torch.Tensor
) -> torch.Tensor | None:
    """`shared_prompt_logits` before the final norm and LM head: the last layer's output [n, T, hidden]
    at the T columns that predict the completion tokens (None when there is nothing to share)."""
    u_ids, u_mask, inverse = distinct_prompts(prompt_ids, prompt_mask)
    (u, p), (n, t) = u_ids.shape, completion_ids.shape
    if u == n:
        return None
    pack = Packing(inverse, u, p, n, t)
    # Positions as the plain forward counts them: a prompt's real tokens from 0, its completion after.
    prompt_pos = (u_mask.cumsum(dim=1) - 1).clamp(min=0)  # [u, P]
    lengths = prompt_mask.sum(dim=1, keepdim=True)  # [n, 1]
    completion_pos = lengths + torch.arange(t, device=lengths.device)  # [n, T]
    ids = torch.cat([u_ids.reshape(1, -1), completion_ids.reshape(1, -1)], dim=1)  # [1, u·P + n·T]
    pos = torch.cat([prompt_pos.reshape(1, -1), completion_pos.reshape(1, -1)], dim=1)
    prompt_ok = visible_keys(u_mask)  # [u, 1, P, P]
    causal = torch.ones(t, t, dtype=torch.bool, device=ids.device).tril()
    completion_ok = torch.cat(  # [n, 1, T, P + T]: the row's real prompt tokens, then causal
        [prompt_mask.bool()[:, None, None, :].expand(n, 1, t, p), causal.expand(n, 1, t, t)], dim=-1
    )
    x = net.embed(ids)  # [1, M, hidden]
    cos, sin = net.rotary(x, pos)
    x = run_layers(net, partial(_layer, net), x, cos, sin, prompt_ok, completion_ok, pack)
    cut = u * p
    last_prompt = x[0, :cut].view(u, p, -1)[inverse, -1:]  # [n, 1, hidden]: predicts completion token 0
    completions = x[0, cut:].view(n, t, -1)[:, : t - 1]  # [n, T-1, hidden]: predict tokens 1..T-1
    return torch.cat([last_prompt, completions], dim=1)  # [n, T, hidden]


def _layer(net: LlamaLayers, i: int, x, cos, sin, prompt_ok, completion_ok, pack: Packing) -> torch.Tensor:
    """Decoder layer i on the packed row x [1, M, hidden]."""
    layer = net.layers[i]
    q, k, v = net.qkv(i, net.norm(x, layer.input_layernorm), cos, sin)  # [1, heads|kv, M, d]
    (qp, qc), (kp, kc), (vp, vc) = pack.split(q), pack.split(k), pack.split(v)
    out_p = net.attention(i, qp, kp, vp, prompt_ok)  # [u, P, heads·d]
    keys = torch.cat([kp[pack.inverse], kc], dim=2)  # [n, kv, P + T, d]
    values = torch.cat([vp[pack.inverse], vc], dim=2)
    out_c = net.attention(i, qc, keys, values, completion_ok)  # [n, T, heads·d]
    heads = torch.cat([out_p.flatten(0, 1), out_c.flatten(0, 1)])[None]  # [1, M, heads·d]
    x = x + net.linear(layer.self_attn.o_proj, heads)
    return x + net.mlp(i, x)
