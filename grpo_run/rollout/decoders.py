"""The forward passes of sampling: transformers' own (`hf`) or ours over a preallocated KV cache (`native`).

Both answer the same four calls, so the sampling loop in `generate.py` does not know which runs:
    prefill(ids [B, P], mask [B, P], positions [B, P]) -> logits of the last column [B, V]
    repeat_rows(k)                                       -> every row's cache repeated k times
    keep_rows(keep [n'])                                 -> only these rows stay in the cache
    step(tokens [n], mask [n, C], positions [n, 1])      -> logits [n, V], after writing column C - 1

Why a native decoder: one decode step of transformers' model call rebuilds its attention masks, appends
to a dynamic cache by concatenation (copying the whole cache every step, so a long completion costs
super-linearly), repeats the key/value heads for grouped-query attention and wraps every output in
dataclasses. The native decoder runs the written-out Llama-family transformer of `models/native.py` (the
model's own embedding, projections, MLPs and LM head; one-call RMSNorms; the rotary embedding by a roll)
with its own cache: allocated once at its final length, a step writes one column, and attention reads
the grouped heads in place (`scaled_dot_product_attention(..., enable_gqa=True)`). It is for the Llama
family (llama, qwen2, qwen3); `generation.backend=auto` picks it for those and transformers' forward for
anything else.
"""

import inspect

import torch
from transformers import DynamicCache, PreTrainedModel

from grpo_run.models.native import LlamaLayers, resolve_backend, visible_keys


def make_decoder(model: PreTrainedModel, backend: str, max_len: int):
    """The decoder for `backend` (auto | native | hf); max_len = prompt columns + new tokens."""
    if resolve_backend(model, backend, "generation.backend") == "native":
        return NativeDecoder(model, max_len)
    return HFDecoder(model)


def cache_argument(model: PreTrainedModel) -> str:
    """The name of the forward's cache argument: `cache` since transformers renamed `past_key_values`
    (within 5.x; the old name is deprecated there). Releases before the rename take an unknown
    `cache=` into **kwargs and ignore it: every step would decode one token with no history."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


class HFDecoder:
    """transformers' forward with its DynamicCache."""

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model
        self.cache = DynamicCache()
        self._cache_arg = {cache_argument(model): self.cache}

    def prefill(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1,
            **self._cache_arg,
        )
        return out.logits[:, -1]

    def repeat_rows(self, k: int) -> None:
        self.cache.batch_repeat_interleave(k)

    def keep_rows(self, keep: torch.Tensor) -> None:
        self.cache.batch_select_indices(keep)

    def step(self, tokens: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        out = self.model(
            input_ids=tokens[:, None],
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            **self._cache_arg,
        )
        return out.logits[:, -1]


class NativeDecoder:
    """The model's modules with our attention over a preallocated cache (Llama family; module docstring)."""

    def __init__(self, model: PreTrainedModel, max_len: int) -> None:
        self.net = LlamaLayers(model)
        self.net.pack_projections()  # a small model's q/k/v and gate/up as one matmul each
        self.max_len = max_len
        self.keys: list[torch.Tensor] = []  # per layer [n, kv_heads, max_len, head_dim], allocated by prefill
        self.values: list[torch.Tensor] = []
        self.length = 0  # columns written
        self.rotary: tuple[torch.Tensor, torch.Tensor] | None = None  # cos, sin' by position (prefill)

    def _write(self, i: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Layer i's keys/values [n, kv_heads, t, d] into columns length..length+t-1."""
        if len(self.keys) == i:  # prefill: the cache at its final length, in the activations' dtype
            shape = (k.size(0), k.size(1), self.max_len, k.size(3))
            self.keys.append(k.new_zeros(shape))
            self.values.append(v.new_zeros(shape))
        cols = slice(self.length, self.length + k.size(2))
        self.keys[i][:, :, cols] = k
        self.values[i][:, :, cols] = v

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, keys_ok: torch.Tensor) -> torch.Tensor:
        """ids [n, t] at columns length..length+t-1 -> logits of the last column [n, V]."""
        net = self.net
        x = net.embed(ids)  # [n, t, hidden]
        if self.length == 0:  # positions never exceed the cache's columns
            self.rotary = net.rotary_table(x, self.max_len)
        if self.rotary is None:
            cos, sin = net.rotary(x, positions)
        else:
            cos, sin = self.rotary[0][positions], self.rotary[1][positions]  # [n, t, 1, d]
        end = self.length + ids.size(1)
        for i, layer in enumerate(net.layers):
            q, k, v = net.qkv(i, net.norm(x, layer.input_layernorm), cos, sin)
            self._write(i, k, v)
            x = x + net.attend(i, q, self.keys[i][:, :, :end], self.values[i][:, :, :end], keys_ok)
            x = x + net.mlp(i, x)
        self.length = end
        return net.head(x[:, -1])  # [n, V]

    def prefill(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        self.keys, self.values, self.length = [], [], 0
        return self._forward(ids, positions, visible_keys(mask))

    def repeat_rows(self, k: int) -> None:
        self.keys = [c.repeat_interleave(k, dim=0) for c in self.keys]
        self.values = [c.repeat_interleave(k, dim=0) for c in self.values]

    def keep_rows(self, keep: torch.Tensor) -> None:
        self.keys = [c[keep] for c in self.keys]
        self.values = [c[keep] for c in self.values]

    def step(self, tokens: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        keys_ok = mask.bool()[:, None, None, :]  # [n, 1, 1, length + 1]
        return self._forward(tokens[:, None], positions, keys_ok)
