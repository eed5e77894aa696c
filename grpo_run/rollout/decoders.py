"""The forward passes of sampling: transformers' own (`hf`) or ours over a preallocated KV cache (`native`).

Both answer the same four calls, so the sampling loop in `generate.py` does not know which runs:
    prefill(ids [B, P], mask [B, P], positions [B, P]) -> logits of the last column [B, V]
    repeat_rows(k)                                       -> every row's cache repeated k times
    keep_rows(keep [n'])                                 -> only these rows stay in the cache
    step(tokens [n], mask [n, C], positions [n, 1])      -> logits [n, V], after writing column C - 1

Why a native decoder: one decode step of transformers' model call rebuilds its attention masks, appends
to a dynamic cache by concatenation (copying the whole cache every step, so a long completion costs
super-linearly), repeats the key/value heads for grouped-query attention and wraps every output in
dataclasses. The native decoder runs the model's own modules (embedding, RMSNorms, projections, MLPs,
rotary embedding, LM head) and replaces only the attention and its cache: the cache is allocated once at
its final length, a step writes one column, and attention reads the grouped heads in place
(`scaled_dot_product_attention(..., enable_gqa=True)`). It is for the Llama family (llama, qwen2, qwen3);
`generation.backend=auto` picks it for those and transformers' forward for anything else.
"""

import torch
import torch.nn.functional as F
from transformers import DynamicCache, PreTrainedModel
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

NATIVE_MODEL_TYPES = ("llama", "qwen2", "qwen3")


def native_unsupported_reason(model: PreTrainedModel) -> str | None:
    """Why the native decoder cannot run this model (None: it can)."""
    cfg = model.config
    if cfg.model_type not in NATIVE_MODEL_TYPES:
        return f"model_type '{cfg.model_type}' is not one of {list(NATIVE_MODEL_TYPES)}"
    if getattr(cfg, "use_sliding_window", False) or "sliding_attention" in (
        getattr(cfg, "layer_types", None) or []
    ):
        return "sliding-window attention is not implemented"
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "layers") or not hasattr(inner, "rotary_emb"):
        return "the model has no .model.layers / .model.rotary_emb"
    return None


def resolve_backend(model: PreTrainedModel, backend: str) -> str:
    """'auto' -> 'native' where supported, else 'hf'; 'native' on an unsupported model is an error."""
    reason = native_unsupported_reason(model)
    if backend == "auto":
        return "hf" if reason else "native"
    if backend == "native" and reason:
        raise ValueError(f"generation.backend=native cannot run this model: {reason}; use generation=hf")
    return backend


def make_decoder(model: PreTrainedModel, backend: str, max_len: int):
    """The decoder for `backend` ('native' or 'hf', resolved); max_len = prompt columns + new tokens."""
    return NativeDecoder(model, max_len) if backend == "native" else HFDecoder(model)


class HFDecoder:
    """transformers' forward with its DynamicCache."""

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model
        self.cache = DynamicCache()

    def prefill(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            cache=self.cache,
            use_cache=True,
            logits_to_keep=1,
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
            cache=self.cache,
            use_cache=True,
        )
        return out.logits[:, -1]


class NativeDecoder:
    """The model's modules with our attention over a preallocated cache (Llama family; module docstring)."""

    def __init__(self, model: PreTrainedModel, max_len: int) -> None:
        cfg = model.config
        self.model = model
        self.inner = model.model
        self.layers = list(self.inner.layers)
        self.heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.max_len = max_len
        self.keys: list[torch.Tensor] = []  # per layer [n, kv_heads, max_len, head_dim], allocated by prefill
        self.values: list[torch.Tensor] = []
        self.length = 0  # columns written

    def _attention(self, i: int, x: torch.Tensor, cos, sin, key_ok: torch.Tensor) -> torch.Tensor:
        """Layer i's attention of x [n, t, hidden] at columns length..length+t-1 (key_ok [n, 1, t|1, length+t])."""
        attn = self.layers[i].self_attn
        n, t, _ = x.shape
        q = attn.q_proj(x).view(n, t, self.heads, self.head_dim)
        k = attn.k_proj(x).view(n, t, self.kv_heads, self.head_dim)
        if hasattr(attn, "q_norm"):  # qwen3 normalises each head before the rotary embedding
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # [n, heads, t, d]
        v = attn.v_proj(x).view(n, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        self._write(i, k, v)
        end = self.length + t
        out = F.scaled_dot_product_attention(
            q,
            self.keys[i][:, :, :end],
            self.values[i][:, :, :end],
            attn_mask=key_ok,
            scale=attn.scaling,
            enable_gqa=self.kv_heads != self.heads,
        )  # [n, heads, t, d]
        return attn.o_proj(out.transpose(1, 2).reshape(n, t, self.heads * self.head_dim))

    def _write(self, i: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Layer i's keys/values [n, kv_heads, t, d] into columns length..length+t-1."""
        if len(self.keys) == i:  # prefill: the cache at its final length, in the activations' dtype
            shape = (k.size(0), self.kv_heads, self.max_len, self.head_dim)
            self.keys.append(k.new_zeros(shape))
            self.values.append(v.new_zeros(shape))
        cols = slice(self.length, self.length + k.size(2))
        self.keys[i][:, :, cols] = k
        self.values[i][:, :, cols] = v

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, key_ok: torch.Tensor) -> torch.Tensor:
        x = self.inner.embed_tokens(ids)  # [n, t, hidden]
        cos, sin = self.inner.rotary_emb(x, positions)
        for i, layer in enumerate(self.layers):
            x = x + self._attention(i, layer.input_layernorm(x), cos, sin, key_ok)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        self.length += ids.size(1)
        return self.model.lm_head(self.inner.norm(x[:, -1]))  # [n, V]

    def prefill(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        p = ids.size(1)
        self.keys, self.values, self.length = [], [], 0
        valid = mask.bool()
        causal = torch.ones(p, p, dtype=torch.bool, device=ids.device).tril()
        # A padding column's query sees only itself: its output is never used, and a row with no visible
        # key would make softmax NaN.
        key_ok = (causal & valid[:, None, :]) | torch.eye(p, dtype=torch.bool, device=ids.device)
        return self._forward(ids, positions, key_ok[:, None])

    def repeat_rows(self, k: int) -> None:
        self.keys = [c.repeat_interleave(k, dim=0) for c in self.keys]
        self.values = [c.repeat_interleave(k, dim=0) for c in self.values]

    def keep_rows(self, keep: torch.Tensor) -> None:
        self.keys = [c[keep] for c in self.keys]
        self.values = [c[keep] for c in self.values]

    def step(self, tokens: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        key_ok = mask.bool()[:, None, None, :]  # [n, 1, 1, length + 1]
        return self._forward(tokens[:, None], positions, key_ok)
