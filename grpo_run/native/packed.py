"""The native training forward on a packed row (`trainer.padding_free`): every sequence of a micro-batch
end to end in one row, attention run per sequence.

The projections, norms and MLP are per token, so they run once over the packed row ([1, L, hidden]: one
matmul per projection over real tokens only). Attention runs piece by piece (`packing.Piece`): a piece's
queries see its own earlier keys and, for a completion after a shared prompt, the prompt's keys; no
query ever sees another sequence's. The arithmetic of each token is the padded forward's; matmuls over
other shapes round differently, so log-probs agree to float rounding (`tests/packing/`).
"""

from functools import partial

import torch

from grpo_run.native.layers import LlamaLayers, run_layers
from grpo_run.packing import PackedRows, Piece


def piece_masks(pieces: tuple[Piece, ...], device: torch.device) -> list[torch.Tensor]:
    """Each piece's visible keys [1, 1, t, prefix + t]: the whole prefix, then causal."""
    masks: dict[tuple[int, int], torch.Tensor] = {}
    out = []
    for p in pieces:
        t, prefix = p.stop - p.start, p.prefix_stop - p.prefix_start
        if (t, prefix) not in masks:
            causal = torch.ones(t, t, dtype=torch.bool, device=device).tril()
            seen = torch.ones(t, prefix, dtype=torch.bool, device=device)
            masks[(t, prefix)] = torch.cat([seen, causal], dim=1)[None, None]
        out.append(masks[(t, prefix)])
    return out


def packed_hidden(net: LlamaLayers, pack: PackedRows) -> torch.Tensor:
    """The last layer's output, final norm applied, at the packed columns that predict the completion
    tokens [1, K, hidden]: the LM head's input."""
    masks = piece_masks(pack.pieces, pack.ids.device)
    x = net.embed(pack.ids)  # [1, L, hidden]
    cos, sin = net.rotary(x, pack.positions)
    x = run_layers(net, partial(_layer, net), x, cos, sin, pack.pieces, masks)
    return net.final_norm(x[:, pack.cols])  # [1, K, hidden]


def _layer(net: LlamaLayers, i: int, x, cos, sin, pieces: tuple[Piece, ...], masks) -> torch.Tensor:
    """Decoder layer i on the packed row x [1, L, hidden]."""
    layer = net.layers[i]
    q, k, v = net.qkv(i, net.norm(x, layer.input_layernorm), cos, sin)  # [1, heads|kv, L, d]
    outs = []
    for p, mask in zip(pieces, masks):
        keys, values = k[:, :, p.start : p.stop], v[:, :, p.start : p.stop]
        if p.prefix_stop > p.prefix_start:
            keys = torch.cat([k[:, :, p.prefix_start : p.prefix_stop], keys], dim=2)
            values = torch.cat([v[:, :, p.prefix_start : p.prefix_stop], values], dim=2)
        outs.append(net.attention(i, q[:, :, p.start : p.stop], keys, values, mask))  # [1, t, heads·d]
    x = x + net.linear(layer.self_attn.o_proj, torch.cat(outs, dim=1))
    return x + net.mlp(i, x)
