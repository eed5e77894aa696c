"""The native decoder: the fast path's forward passes of sampling, over a preallocated KV cache.

It answers the `rollout/decoders.py` interface (prefill, repeat_rows, keep_rows, step), so the group
sampler in `rollout/generate.py` runs it like transformers' own. Why: one decode step of transformers'
model call rebuilds its attention masks, appends to a dynamic cache by concatenation (copying the whole
cache every step, so a long completion costs super-linearly), repeats the key/value heads for
grouped-query attention and wraps every output in dataclasses. This decoder runs the written-out
Llama-family transformer of `layers.py` (the model's own embedding, projections, MLPs and LM head;
one-call RMSNorms; the rotary embedding by a roll) with its own cache: allocated once at its final
length, a step writes one column, and attention reads the grouped heads in place
(`scaled_dot_product_attention(..., enable_gqa=True)`). Llama family only (llama, qwen2, qwen3);
`backend.decoder=auto` falls back to transformers' forward for anything else (`native_decoder`).
"""

from collections.abc import Callable

import torch
from transformers import PreTrainedModel

from grpo_run.native.layers import LlamaLayers, resolve_backend, visible_keys
from grpo_run.rollout.decoders import Decoder, HFDecoder
from grpo_run.rollout.generate import CachedRows
from grpo_run.safety.stop import stop_requested


def native_decoder(model: PreTrainedModel, choice: str) -> Callable[[PreTrainedModel, int], Decoder]:
    """The decoder class for `backend.decoder` (auto | native | hf) on this model."""
    return NativeDecoder if resolve_backend(model, choice, "backend.decoder") == "native" else HFDecoder


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
            # A prefill over many long rows takes seconds per call on a CPU: a stop ends it between
            # layers. What it returns then is cut short, like the decode loop's tokens, and the caller
            # discards it at its next stop point (safety/stop.py); a decode step (one column) is short.
            if ids.size(1) > 1 and stop_requested():
                break
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

    # Continuing rows across calls (multi-turn episodes, `rollout/turns.py`).

    def export_rows(self, which: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The written columns of the rows `which` ([n] bool): per layer keys and values [k, kv_heads, C, d]."""
        return [c[which, :, : self.length] for c in self.keys], [
            c[which, :, : self.length] for c in self.values
        ]

    def extend(
        self, cached: CachedRows, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """Rows' cache (`cached`, C columns) and a chunk appended after it: ids [n, S] left-padded (mask
        [n, S]) at positions [n, S] -> logits of the chunk's last column [n, V]. The chunk's queries see
        the cached columns that hold a token and the chunk causally; the cache goes on to max_len."""
        n, cols = cached.valid.shape
        self.keys, self.values = [], []
        for k, v in zip(cached.keys, cached.values, strict=True):
            shape = (n, k.size(1), self.max_len, k.size(3))
            self.keys.append(k.new_zeros(shape))
            self.values.append(v.new_zeros(shape))
            self.keys[-1][:, :, :cols] = k
            self.values[-1][:, :, :cols] = v
        self.length = cols
        self.rotary = self.net.rotary_table(self.net.embed(ids[:1, :1]), self.max_len)
        chunk = visible_keys(mask)  # [n, 1, S, S]
        old = cached.valid[:, None, None, :].expand(n, 1, ids.size(1), cols)  # [n, 1, S, C]
        return self._forward(ids, positions, torch.cat([old, chunk], dim=-1))
