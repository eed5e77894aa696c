"""The packer: prompts' real tokens and completions end to end, positions restarting, the predicting
columns, and per-token values back to [n, T]."""

import torch

from grpo_run.packing import Piece, pack_rows


def rows():
    # Row 0: prompt [5, 6] (one padding column), completion [7, 8, 1]; row 1: prompt [9, 6, 4],
    # completion [3] then padding; row 2: row 0's prompt, completion [2, 2].
    prompt_ids = torch.tensor([[0, 5, 6], [9, 6, 4], [0, 5, 6]])
    prompt_mask = torch.tensor([[0, 1, 1], [1, 1, 1], [0, 1, 1]])
    completion_ids = torch.tensor([[7, 8, 1], [3, 0, 0], [2, 2, 0]])
    completion_mask = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0]])
    return prompt_ids, prompt_mask, completion_ids, completion_mask


def test_each_row_one_sequence():
    pack = pack_rows(*rows())
    assert pack.ids.tolist() == [[5, 6, 7, 8, 1, 9, 6, 4, 3, 5, 6, 2, 2]]
    assert pack.positions.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3, 0, 1, 2, 3]]
    assert pack.pieces == (Piece(0, 5), Piece(5, 9), Piece(9, 13))
    # Column p - 1 + j of each sequence predicts its completion token j.
    assert pack.cols.tolist() == [1, 2, 3, 7, 10, 11]
    assert pack.targets.tolist() == [[7, 8, 1, 3, 2, 2]]
    assert (pack.rows, pack.width) == (3, 3)


def test_shared_prompts_go_in_once_as_a_prefix():
    pack = pack_rows(*rows(), share_prompts=True)
    # Prompt [5, 6] at 0-1, row 0's completion at 2-4, prompt [9, 6, 4] at 5-7, row 1's at 8, row 2's at 9-10.
    assert pack.ids.tolist() == [[5, 6, 7, 8, 1, 9, 6, 4, 3, 2, 2]]
    assert pack.positions.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3, 2, 3]]
    assert pack.pieces == (Piece(0, 2), Piece(2, 5, 0, 2), Piece(5, 8), Piece(8, 9, 5, 8), Piece(9, 11, 0, 2))
    # Each completion's token 0 is predicted by its prompt's last column, the rest by its own columns.
    assert pack.cols.tolist() == [1, 2, 3, 7, 1, 9]
    assert pack.targets.tolist() == [[7, 8, 1, 3, 2, 2]]


def test_unpack_puts_each_value_at_its_row_and_column_and_zero_elsewhere():
    pack = pack_rows(*rows())
    values = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]], requires_grad=True)
    out = pack.unpack(values)
    assert out.tolist() == [[1, 2, 3], [4, 0, 0], [5, 6, 0]]
    out.sum().backward()
    assert values.grad.tolist() == [[1.0] * 6]


def test_a_row_without_completion_tokens_packs_its_prompt_only():
    p, pm, c, cm = rows()
    cm = cm.clone()
    cm[1] = 0
    pack = pack_rows(p, pm, c, cm)
    assert pack.targets.tolist() == [[7, 8, 1, 2, 2]]
    assert pack.unpack(torch.ones(1, 5)).tolist() == [[1, 1, 1], [0, 0, 0], [1, 1, 0]]
