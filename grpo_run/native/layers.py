"""The Llama-family transformer (llama, qwen2, qwen3) written out over the model's own parameters.

Shared by the native decoder (`decoder.py`, with a KV cache) and the native training forward
(`native_logits`, the log-prob forward of the update). Why: transformers' forward pays per call for
mask construction, output capturing and dataclass wrapping, and per layer for an RMSNorm of seven
element-wise ops and a rotary embedding of seven more (each again in the backward). Here an RMSNorm is
one call with a closed-form backward (`rms_norm.py`) and the rotary embedding is
`x·cos + roll(x, d/2)·sin'` with the sign of `rotate_half` folded into sin' once per forward. The
arithmetic is the same as transformers' (the same float32 upcast in the norm, the same products and
sums in the rotary), so the logits agree to float32 rounding (`tests/native/test_layers.py`).
Projections, MLPs, embeddings and the LM head are the model's own modules, so gradients land on the
model's parameters as usual (DeepSpeed ZeRO-1/2 included).
"""

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from transformers import PreTrainedModel

from grpo_run.native.heap import MIN_FREE_BYTES, release_free_memory
from grpo_run.native.lean_ops import attention_core, swiglu, swiglu_linear
from grpo_run.native.rms_norm import rms_norm
from grpo_run.native.weight_casts import SharedCast, WeightCasts

NATIVE_MODEL_TYPES = ("llama", "qwen2", "qwen3")
# In-layer heap trims only for layer inputs at least this large: a smaller layer frees little between
# trims and runs quickly, so glibc's count of free memory (mallinfo2 walks every free chunk, which is slow
# over a fragmented heap) would cost more than the trim gives back.
TRIM_MIN_INPUT_BYTES = 2**20
# Sampling packs a layer's q/k/v and gate/up weights into one matmul each (`pack_projections`) when the
# packed copies come to at most this much: for a small model, where each kernel's dispatch costs more than
# its arithmetic, fewer calls make a faster decode step; a large one would pay memory for nothing.
PACK_MAX_BYTES = 32 * 2**20
BACKENDS = ("auto", "native", "hf")


def native_unsupported_reason(model: PreTrainedModel) -> str | None:
    """Why the native forward cannot run this model (None: it can)."""
    cfg = model.config
    if cfg.model_type not in NATIVE_MODEL_TYPES:
        return f"model_type '{cfg.model_type}' is not one of {list(NATIVE_MODEL_TYPES)}"
    if getattr(cfg, "use_sliding_window", False) or "sliding_attention" in (
        getattr(cfg, "layer_types", None) or []
    ):
        return "sliding-window attention is not implemented"
    attn = getattr(cfg, "_attn_implementation", None)
    if attn not in (None, "eager", "sdpa"):  # e.g. flash_attention_2: transformers' forward keeps it
        return f"attn_implementation '{attn}' is not eager or sdpa"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"hidden_act '{cfg.hidden_act}' is not silu"
    if getattr(cfg, "attention_dropout", 0.0):
        return "attention dropout is not implemented"
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "layers") or not hasattr(inner, "rotary_emb"):
        return "the model has no .model.layers / .model.rotary_emb"
    return None


def resolve_backend(model: PreTrainedModel, backend: str, key: str) -> str:
    """'auto' -> 'native' where supported, else 'hf'; 'native' on an unsupported model is an error
    that names the config key."""
    reason = native_unsupported_reason(model)
    if backend == "auto":
        return "hf" if reason else "native"
    if backend == "native" and reason:
        raise ValueError(f"{key}=native cannot run this model: {reason}; use {key}=hf")
    return backend


def visible_keys(mask: torch.Tensor) -> torch.Tensor:
    """Which keys each query may attend to: mask [n, L] (1 = token) -> bool [n, 1, L, L].

    Causal and not padding. A padding column's query sees only itself: its output is never used,
    and a row with no visible key would make the softmax NaN.
    """
    length = mask.size(1)
    causal = torch.ones(length, length, dtype=torch.bool, device=mask.device).tril()
    eye = torch.eye(length, dtype=torch.bool, device=mask.device)
    return ((causal & mask.bool()[:, None, :]) | eye)[:, None]


def _plain_linear(module: torch.nn.Module) -> bool:
    """A plain `nn.Linear` without hooks: its forward is `F.linear` on its own weight and bias (a
    subclass, a wrapper such as an adapter's, or a hook may do more)."""
    return type(module) is torch.nn.Linear and not module._forward_hooks and not module._forward_pre_hooks


class Packed(NamedTuple):
    """One layer's projections concatenated along their outputs (`LlamaLayers.pack_projections`)."""

    qkv: torch.Tensor  # [(heads + 2 kv_heads) · d, hidden]
    qkv_bias: torch.Tensor | None
    gate_up: torch.Tensor  # [2 · intermediate, hidden]


class LlamaLayers:
    """The pieces of one forward, over a Llama-family model's modules (no copies of its weights)."""

    def __init__(
        self,
        model: PreTrainedModel,
        casts: WeightCasts | None = None,
        trim_every: int = 0,
        *,
        head_follows: bool = False,
    ) -> None:
        cfg = model.config
        self.model = model
        self.casts = casts  # the projections' bf16 weights of this optimizer step, under autocast
        self.trim_every = trim_every  # training: the C heap trimmed every this many layers (run_layers)
        # The caller puts the LM head in the same graph (`embed`: a tied lookup's gradient may be sparse).
        self.head_follows = head_follows
        self.inner = model.model
        self.layers = list(self.inner.layers)
        self.heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        # transformers' eager attention (matmul, float32 softmax, matmul) is its CPU training choice for
        # SmolLM2 (conf/model/smollm2-135m.yaml); otherwise scaled_dot_product_attention, except on CPU in
        # half precision (`use_eager`).
        self.eager = getattr(cfg, "_attn_implementation", None) == "eager"
        self.packs: list[Packed] | None = None  # pack_projections: per layer, for a forward without grad
        self.tied_head_cast: torch.Tensor | None = None  # `embed`'s share of a tied weight for the head
        self.tied_head_grads: list | None = None  # where the fused head may hand that cast's gradient

    def pack_projections(self, max_bytes: int = PACK_MAX_BYTES) -> bool:
        """Concatenate each layer's q/k/v weights (and biases) and its gate/up weights, so `qkv` and `mlp`
        make one matmul of each instead of three and two. The packs are copies: only for a forward with
        fixed weights and no gradient (the decoder, within one generation), only for plain `nn.Linear`
        projections without hooks, and only within `max_bytes`. True when packed."""
        modules = []
        for layer in self.layers:
            a, m = layer.self_attn, layer.mlp
            group = (a.q_proj, a.k_proj, a.v_proj, m.gate_proj, m.up_proj)
            no_mlp_bias = m.gate_proj.bias is None and m.up_proj.bias is None
            qkv_bias_alike = len({x.bias is None for x in group[:3]}) == 1  # all with a bias or all without
            if not (all(map(_plain_linear, group)) and no_mlp_bias and qkv_bias_alike):
                return False
            modules.append(group)
        if sum(x.weight.nbytes for group in modules for x in group) > max_bytes:
            return False
        with torch.no_grad():
            self.packs = [
                Packed(
                    qkv=torch.cat([q.weight, k.weight, v.weight]),
                    qkv_bias=None if q.bias is None else torch.cat([q.bias, k.bias, v.bias]),
                    gate_up=torch.cat([g.weight, u.weight]),
                )
                for q, k, v, g, u in modules
            ]
        return True

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings [n, t, hidden] of ids [n, t].

        With a tied LM head that the caller applies in the same graph (`head_follows`) the lookup's
        gradient is sparse (one row per token): autograd adds it into the head's dense [V, hidden]
        gradient, which the shared weight receives anyway, instead of first filling a dense zero
        [V, hidden] buffer of its own (V · hidden · 4 bytes in float32) and summing the two. The weight's
        `.grad` is the same dense tensor as before (`tests/native/test_layers.py`). Without the head's
        gradient it would be left sparse, which the optimizer cannot take: hence the flag. Under
        autocast with `casts`, the lookup and the head's cast come from one node (`WeightCasts.tied`),
        so that the head's gradient waits for the lookup's in bf16 rather than float32."""
        emb = self.inner.embed_tokens
        head = self.model.get_output_embeddings()
        tied = self.head_follows and head is not None and head.weight is emb.weight
        if not (tied and emb.weight.requires_grad and torch.is_grad_enabled()) or emb.max_norm is not None:
            return emb(ids)  # [n, t, hidden]
        weight = emb.weight
        if self.casts is not None and torch.is_autocast_enabled(weight.device.type):
            # The head's kept cast and the lookup joined in one node (`WeightCasts.tied`): the head's
            # gradient waits for the lookup's in bf16; `head_weight` hands the cast to the head.
            weight, self.tied_head_cast, self.tied_head_grads = self.casts.tied(weight)
        return F.embedding(
            ids, weight, emb.padding_idx, scale_grad_by_freq=emb.scale_grad_by_freq, sparse=True
        )

    def rotary(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sign-folded sin [n, t, 1, head_dim] for positions [n, t] (x gives device and dtype).

        rotate_half(x) = cat(-x2, x1) = roll(x, d/2) * [-1…-1, 1…1], so x·cos + rotate_half(x)·sin
        = x·cos + roll(x, d/2)·sin' with sin' = sin · [-1…-1, 1…1] (exact: only signs move).
        """
        cos, sin = self.inner.rotary_emb(x, positions)  # [n, t, d]
        half = sin.size(-1) // 2
        sign = torch.ones(sin.size(-1), dtype=sin.dtype, device=sin.device)
        sign[:half] = -1
        return cos[:, :, None], (sin * sign)[:, :, None]

    def rotary_table(self, x: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`rotary` for positions 0..length-1, [length, 1, head_dim] each: a decoder looks its rows up
        by position (`table[positions]`, the same numbers: each position's are computed on their own)
        instead of running the rotary embedding's dozen ops at every step. None for a RoPE whose
        frequencies depend on the longest position seen (transformers' dynamic and longrope types)."""
        rope_type = str(getattr(self.inner.rotary_emb, "rope_type", "default"))
        if "dynamic" in rope_type or "longrope" in rope_type:
            return None
        cos, sin = self.rotary(x[:1, :1], torch.arange(length, device=x.device)[None])  # [1, length, 1, d]
        return cos[0], sin[0]

    def linear(self, module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
        """A projection: `F.linear` on its weight (under autocast with `casts`, the weight's kept cast).

        A plain `nn.Linear` without hooks is called as `F.linear` directly: the same op, without
        `Module.__call__`'s per-call overhead, which a small model's decode step (every projection of
        every layer, each a small matmul) pays many times; anything else (a subclass, a wrapper, hooks)
        runs as the module itself."""
        if not _plain_linear(module):
            return module(x)
        if self.casts is None or not torch.is_autocast_enabled(x.device.type):
            return F.linear(x, module.weight, module.bias)
        return F.linear(x, self.kept_cast(module.weight), module.bias)

    def matmul_weight(self, module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor | None:
        """The weight `linear(module, x)` multiplies x by, where that call is `F.linear(x, weight)` in
        x's dtype: a plain bias-free `nn.Linear`, under autocast with `casts` (its kept cast) or without
        autocast. None otherwise (a wrapped module, a bias, autocast casting the weight at the call)."""
        if not _plain_linear(module) or module.bias is not None:
            return None
        if torch.is_autocast_enabled(x.device.type):
            return None if self.casts is None else self.kept_cast(module.weight)
        return module.weight if module.weight.dtype == x.dtype else None

    def matmul_input(self, h: torch.Tensor) -> Callable[[], torch.Tensor]:
        """h for the projections that read it, one call per projection: under autocast with `casts`,
        cast once for all of them (`SharedCast`: the same bits, one saved copy); otherwise h itself."""
        device = h.device.type
        if self.casts is None or not torch.is_autocast_enabled(device):
            return lambda: h
        dtype = torch.get_autocast_dtype(device)
        return (lambda: h) if h.dtype == dtype else SharedCast(h, dtype)

    def kept_cast(self, weight: torch.Tensor) -> torch.Tensor:
        """A weight's kept cast (`casts`); a tied LM head's is the one `embed` joined to the lookup,
        handed out once: from then on the head's graph holds it, and frees it with the head's backward.
        This object lives on through the backward (a checkpointed layer's recomputation calls it), so
        holding the cast here would keep a bf16 [V, hidden] tensor to the end of the backward."""
        if self.tied_head_cast is not None and weight is self.inner.embed_tokens.weight:
            cast, self.tied_head_cast = self.tied_head_cast, None
            return cast
        return self.casts(weight)

    @staticmethod
    def norm(x: torch.Tensor, module: torch.nn.Module) -> torch.Tensor:
        """transformers' Llama/Qwen RMSNorm in one call (float32 statistics, weight applied after
        casting back to x's dtype, as there); in training, with a closed-form backward (`rms_norm.py`)."""
        return rms_norm(x, module.weight, module.variance_epsilon)

    def qkv(self, i: int, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Layer i's queries [n, heads, t, d], and keys and values [n, kv_heads, t, d], rotary applied."""
        attn = self.layers[i].self_attn
        n, t, _ = h.shape
        half = self.head_dim // 2
        if self.packs is not None and not hasattr(attn, "q_norm"):  # one matmul, one rotary for q and k
            heads, pack = self.heads + self.kv_heads, self.packs[i]
            qkv = F.linear(h, pack.qkv, pack.qkv_bias).view(n, t, heads + self.kv_heads, self.head_dim)
            qk = qkv[:, :, :heads]
            qk = (qk * cos + torch.roll(qk, half, dims=-1) * sin).transpose(1, 2)  # [n, heads + kv, t, d]
            return qk[:, : self.heads], qk[:, self.heads :], qkv[:, :, heads:].transpose(1, 2)
        src = self.matmul_input(h)
        q = self.linear(attn.q_proj, src()).view(n, t, self.heads, self.head_dim)
        k = self.linear(attn.k_proj, src()).view(n, t, self.kv_heads, self.head_dim)
        v = self.linear(attn.v_proj, src()).view(n, t, self.kv_heads, self.head_dim).transpose(1, 2)
        if hasattr(attn, "q_norm"):  # qwen3 normalises each head before the rotary embedding
            q, k = self.norm(q, attn.q_norm), self.norm(k, attn.k_norm)
        q = (q * cos + torch.roll(q, half, dims=-1) * sin).transpose(1, 2)
        k = (k * cos + torch.roll(k, half, dims=-1) * sin).transpose(1, 2)
        return q, k, v

    def attend(self, i: int, q, k, v, keys_ok: torch.Tensor) -> torch.Tensor:
        """Layer i's attention output after o_proj [n, t, hidden]: q [n, heads, t, d] over k, v
        [n, kv_heads, s, d] where keys_ok [n, 1, t|1, s] allows."""
        return self.linear(self.layers[i].self_attn.o_proj, self.attention(i, q, k, v, keys_ok))

    def use_eager(self, q: torch.Tensor) -> bool:
        """The eager form for these queries: where the model asks for it, and on CPU in bf16/fp16, where
        torch's scaled_dot_product_attention is slower than the whole eager form, in decoding and in the
        update alike. In float32 the two run alike, and on a GPU sdpa's fused kernels are the point, so
        both keep it."""
        return self.eager or (q.device.type == "cpu" and q.dtype in (torch.bfloat16, torch.float16))

    def attention(self, i: int, q, k, v, keys_ok: torch.Tensor) -> torch.Tensor:
        """`attend` before o_proj: the heads' outputs side by side [n, t, heads * d]."""
        attn = self.layers[i].self_attn
        n, _, t, _ = q.shape
        if self.use_eager(q):
            # transformers' eager_attention_forward: the same float32 softmax over bf16 scores.
            # A key/value head's `group` query heads are one matmul's rows (no repeated copies of k and v);
            # the scale goes on q (d columns, not s): exact for a power-of-two scale like 64^-0.5, and
            # masked keys get the dtype's lowest value, which is what adding it gives after rounding.
            # Scores [n, heads, t, s], float32 softmax rounded to their dtype, then v (`attention_core`).
            group, d = self.heads // self.kv_heads, q.size(3)
            grouped = (q * attn.scaling).reshape(n, self.kv_heads, group * t, d)
            out = attention_core(grouped, k, v, keys_ok, self.heads).view(n, self.heads, t, d)
        else:
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=keys_ok, scale=attn.scaling, enable_gqa=self.kv_heads != self.heads
            )  # [n, heads, t, d]
        return out.transpose(1, 2).reshape(n, t, self.heads * self.head_dim)

    def mlp(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """Layer i's MLP on the post-attention norm of the residual x [n, t, hidden]."""
        layer = self.layers[i]
        h = self.norm(x, layer.post_attention_layernorm)
        m = layer.mlp
        if self.packs is not None:
            gate, up = F.linear(h, self.packs[i].gate_up).chunk(2, dim=-1)
            return self.linear(m.down_proj, F.silu(gate) * up)
        src = self.matmul_input(h)
        gate, up = self.linear(m.gate_proj, src()), self.linear(m.up_proj, src())
        weight = self.matmul_weight(m.down_proj, gate)
        if weight is None:
            return self.linear(m.down_proj, swiglu(gate, up))
        return swiglu_linear(gate, up, weight)  # down_proj(silu(gate) · up)

    def layer(self, i: int, x: torch.Tensor, cos, sin, keys_ok: torch.Tensor) -> torch.Tensor:
        """Decoder layer i without a cache: residual x [n, L, hidden] -> [n, L, hidden]."""
        q, k, v = self.qkv(i, self.norm(x, self.layers[i].input_layernorm), cos, sin)
        x = x + self.attend(i, q, k, v, keys_ok)
        return x + self.mlp(i, x)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head: hidden [n, t, hidden] -> logits [n, t, V]."""
        return self.linear(self.model.lm_head, self.final_norm(x))

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        """The last layer's output [n, t, hidden] normed: the LM head's input."""
        return self.norm(x, self.inner.norm)

    def head_weight(self) -> tuple[torch.Tensor, list | None]:
        """The LM head's weight [V, hidden] as `head` reads it (its kept cast under autocast with `casts`),
        and where that is the tied cast `embed` made, the list its gradient may be handed over in
        (`WeightCasts.tied`; None otherwise)."""
        weight = self.model.lm_head.weight
        if self.casts is None or not torch.is_autocast_enabled(weight.device.type):
            return weight, None
        grads, self.tied_head_grads = self.tied_head_grads, None
        tied = self.tied_head_cast is not None and weight is self.inner.embed_tokens.weight
        return self.kept_cast(weight), grads if tied else None


def run_layers(net: LlamaLayers, step: Callable[..., torch.Tensor], x: torch.Tensor, *args) -> torch.Tensor:
    """x through every layer: `step(i, x, *args)` for layer i, checkpointed where transformers' switch
    (`model.gradient_checkpointing`, set per layer) is on in training, as transformers' own layers do.

    No RNG to replay: the native forward has no dropout (native_unsupported_reason). Reentrant: the layer
    runs under no_grad and is replayed inside backward, without the non-reentrant form's hook on every
    saved tensor, a cost that dominates a small model's micro-batch. It needs an input that requires grad
    to join the graph, so frozen embeddings take the other form.
    The last layer keeps its activations: the backward starts with it, so checkpointing it would only
    recompute, right away, what its forward just freed; the memory held is the same, minus the LM head
    and loss in between (which the fused head keeps to a few chunks of rows).
    `net.trim_every`: before every such layer, in the forward and in its recomputation, the C heap's
    free pages go back to the OS (`_trimming`), for layer inputs of `TRIM_MIN_INPUT_BYTES` or more.
    """
    training = net.model.training and torch.is_grad_enabled()
    last = len(net.layers) - 1
    # The C heap holds CPU tensors only.
    if training and net.trim_every > 0 and x.device.type == "cpu" and x.nbytes >= TRIM_MIN_INPUT_BYTES:
        step = _trimming(step, net.trim_every)
    for i, layer in enumerate(net.layers):
        if training and i < last and getattr(layer, "gradient_checkpointing", False):
            x = checkpoint(step, i, x, *args, use_reentrant=x.requires_grad, preserve_rng_state=False)
        else:
            x = step(i, x, *args)
    return x


def _trimming(step: Callable[..., torch.Tensor], every: int) -> Callable[..., torch.Tensor]:
    """`step`, returning the C heap's free pages before layers 0, every, 2·every, … (when 64 MB are free).

    A layer's transients (several MB each for a model of SmolLM2's size) come from the heap between
    tensors that live longer, and their freed pages stay resident; over a forward and a backward they
    add up to a large share of the peak. Inside the checkpointed function, so the recomputation in the
    backward trims as well."""

    def trimmed(i: int, x: torch.Tensor, *args) -> torch.Tensor:
        if i % every == 0:
            release_free_memory(MIN_FREE_BYTES)
        return step(i, x, *args)

    return trimmed


def native_logits(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    logits_to_keep: int | torch.Tensor,
    casts: WeightCasts | None = None,
) -> torch.Tensor:
    """The training forward: ids, mask, positions [n, L] -> logits [n, k, V] of the last
    `logits_to_keep` columns (an int) or of the columns it lists (a 1-D index tensor of k columns), as
    `model(..., logits_to_keep=...)` computes them.

    Where transformers' gradient checkpointing is on, each layer keeps only its input for backward and
    recomputes the rest (`run_layers`). `casts`: the projections' weights cast once per optimizer step
    (`weight_casts.py`).
    """
    keep = logits_to_keep if isinstance(logits_to_keep, torch.Tensor) else slice(-logits_to_keep, None)
    net = LlamaLayers(model, casts, head_follows=True)
    return net.head(native_hidden(net, input_ids, attention_mask, position_ids)[:, keep])  # [n, k, V]


def native_hidden(
    net: LlamaLayers, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor
) -> torch.Tensor:
    """`native_logits` before the final norm and LM head: ids, mask, positions [n, L] -> the last
    layer's output [n, L, hidden]."""
    keys_ok = visible_keys(attention_mask)  # [n, 1, L, L]
    x = net.embed(input_ids)  # [n, L, hidden]
    cos, sin = net.rotary(x, position_ids)
    return run_layers(net, net.layer, x, cos, sin, keys_ok)
