"""A micro-batch's rows laid end to end in one row, and per-token results taken back to [n, T].

Each row's real prompt tokens and its completion's tokens (up to and including the first EOS) go into
one packed row with positions restarting per sequence; attention is confined to each sequence by the
`pieces`, the spans of the packed row that attend to themselves causally (after a prefix of keys
they all see: a prompt shared by several completions). The LM head reads only the columns that predict
a completion token (`cols`), so neither left padding nor the padding after an EOS is ever computed.
"""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Piece:
    """Columns start..stop of the packed row attend causally to themselves and, before that, to every
    column of prefix_start..prefix_stop (a shared prompt; empty when the piece holds its own prompt)."""

    start: int
    stop: int
    prefix_start: int = 0
    prefix_stop: int = 0


@dataclass(frozen=True)
class PackedRows:
    """n rows of a micro-batch as one packed row of L tokens, K of which predict completion tokens."""

    ids: torch.Tensor  # [1, L]
    positions: torch.Tensor  # [1, L] restarting at 0 per sequence
    pieces: tuple[Piece, ...]  # in the packed row's order, covering it
    cols: torch.Tensor  # [K] the packed column that predicts each completion token
    targets: torch.Tensor  # [1, K] the completion tokens
    flat_index: torch.Tensor  # [K] row · T + column of each completion token in the [n, T] result
    rows: int  # n
    width: int  # T: the micro-batch's longest completion (at least 1), as `trim_columns` keeps

    @property
    def shares_prompts(self) -> bool:
        return any(p.prefix_stop > p.prefix_start for p in self.pieces)

    def unpack(self, values: torch.Tensor) -> torch.Tensor:
        """Per-token values [1, K] (or [K]) → [n, T], 0 where a row has no completion token (with
        gradient: each value lands in one place)."""
        flat = values.new_zeros(self.rows * self.width)
        return flat.index_copy(0, self.flat_index, values.reshape(-1)).view(self.rows, self.width)


def pack_rows(
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    *,
    share_prompts: bool = False,
) -> PackedRows:
    """Rows [n, P] (left-padded prompts) and [n, T] (completions, mask 1 up to the first EOS) → one packed
    row. With `share_prompts` each distinct prompt goes in once, its completions after it, each seeing
    the prompt as a prefix (`Piece`); otherwise each row is a sequence of its own."""
    n = prompt_ids.size(0)
    device = prompt_ids.device
    p_len = prompt_mask.sum(1).tolist()
    c_len = completion_mask.sum(1).tolist()
    if min(p_len) < 1:
        raise ValueError("packing needs at least one prompt token per row")
    width = max(max(c_len), 1)
    keys = prompt_keys(prompt_ids, prompt_mask) if share_prompts else list(range(n))
    prompt_ids_of = [prompt_ids[r, prompt_ids.size(1) - p_len[r] :] for r in range(n)]
    ids, positions, pieces, cols, flat = [], [], [], [], []
    placed: dict[int, tuple[int, int]] = {}  # prompt key -> (start, length) of its tokens when shared
    at = 0
    for r in range(n):
        p, c = p_len[r], c_len[r]
        if share_prompts:
            if keys[r] not in placed:
                ids.append(prompt_ids_of[r])
                positions.append(torch.arange(p, device=device))
                pieces.append(Piece(at, at + p))
                placed[keys[r]] = (at, p)
                at += p
            if c == 0:
                continue
            start, _ = placed[keys[r]]
            ids.append(completion_ids[r, :c])
            positions.append(torch.arange(p, p + c, device=device))
            pieces.append(Piece(at, at + c, start, start + p))
            cols.append(torch.tensor([start + p - 1], device=device))  # the prompt's last token
            cols.append(torch.arange(at, at + c - 1, device=device))
            at += c
        else:
            ids += [prompt_ids_of[r], completion_ids[r, :c]]
            positions.append(torch.arange(p + c, device=device))
            pieces.append(Piece(at, at + p + c))
            cols.append(torch.arange(at + p - 1, at + p + c - 1, device=device))
            at += p + c
        flat.append(r * width + torch.arange(c, device=device))
    ids_row = torch.cat(ids)[None]  # [1, L]
    col_index = torch.cat(cols) if cols else torch.zeros(0, dtype=torch.long, device=device)
    flat_index = torch.cat(flat) if flat else torch.zeros(0, dtype=torch.long, device=device)
    targets = torch.cat([completion_ids[r, : c_len[r]] for r in range(n)])[None]  # [1, K]
    return PackedRows(
        ids_row,
        torch.cat(positions)[None],
        tuple(pieces),
        col_index,
        targets,
        flat_index,
        n,
        width,
    )


def prompt_keys(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> list[int]:
    """Each row's prompt among the distinct (ids, mask) rows [n]: equal keys share a prompt."""
    rows = torch.cat([prompt_ids, prompt_mask.to(prompt_ids.dtype)], dim=1)  # [n, 2P]
    return torch.unique(rows, dim=0, return_inverse=True)[1].tolist()
