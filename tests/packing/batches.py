"""A micro-batch with spread lengths for the packing tests: left-padded prompts (two rows share one),
completions of 0 to 7 tokens (one empty)."""

import torch

from tests.native.builders import VOCAB


def spread_rows():
    """(prompt ids [6, 8], prompt mask, completion ids [6, 7], completion mask)."""
    g = torch.Generator().manual_seed(3)
    n, p, t = 6, 8, 7
    prompt_ids = torch.randint(2, VOCAB, (n, p), generator=g)
    prompt_mask = torch.ones(n, p, dtype=torch.long)
    for r in range(n):
        prompt_mask[r, : r % 4] = 0
    prompt_ids = prompt_ids.masked_fill(prompt_mask == 0, 0)
    prompt_ids[1], prompt_mask[1] = prompt_ids[0], prompt_mask[0]  # rows 0 and 1 share a prompt
    completion_ids = torch.randint(2, VOCAB, (n, t), generator=g)
    completion_mask = torch.zeros(n, t, dtype=torch.long)
    for r, c in enumerate([7, 3, 5, 1, 0, 6]):
        completion_mask[r, :c] = 1
    return prompt_ids, prompt_mask, completion_ids.masked_fill(completion_mask == 0, 0), completion_mask
