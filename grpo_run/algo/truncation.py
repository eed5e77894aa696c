"""Truncated sampling: the tokens min_p / top-k / top-p keep, and a sampled token's log-prob on either support.

A sampler with temperature T and truncation draws token i from q_i = p_i / Z on the kept set K, where
p = softmax(z / T) is the full tempered distribution and Z = sum_{j in K} p_j the kept mass; off K, q = 0.
The filters run in vLLM's order: min_p (drop p_i < min_p * max p), then top-k (drop logits below the
k-th largest), then top-p on what is left, renormalised (drop a token once the mass before it, in
descending order, reaches top_p; the first always stays).

Which of the two log-probs the rest of the run uses (docs/algorithm.md, "Which log-probs each term
uses"): the trainer's pi_theta / pi_old / pi_ref are log p on the full vocabulary, so the sampler's
log-probs that get compared with them (`Rollout.sampler_logprobs`) are log p_i as well (`full`). The
renormalised log q_i = log p_i - log Z (`truncated`) would put a factor Z (every kept token's, at every
position) into pi_old / pi_sampler that no policy change caused (TRL #6789).
"""

import math
from typing import NamedTuple

import torch


def truncates(*, top_k: int, top_p: float, min_p: float) -> bool:
    """Whether these settings can drop any token (top_k 0, top_p 1 and min_p 0 keep the whole vocabulary)."""
    return top_k > 0 or top_p < 1.0 or min_p > 0.0


def kept_tokens(logits: torch.Tensor, *, top_k: int, top_p: float, min_p: float = 0.0) -> torch.Tensor:
    """The kept set K of each row: logits [n, V] (already divided by the temperature) -> bool [n, V].

    min_p, then top-k, then top-p (module docstring); a top-k ties with its k-th logit keep every tied
    token. Rows with nothing to drop come back all True."""
    kept = torch.ones_like(logits, dtype=torch.bool)  # [n, V]
    if min_p > 0.0:
        # p_i < min_p * max p  <=>  z_i < max z + log(min_p): the same test without a softmax.
        kept &= logits >= logits.amax(dim=-1, keepdim=True) + math.log(min_p)
    if top_k > 0 and top_k < logits.size(-1):
        ranked = logits if min_p == 0.0 else logits.masked_fill(~kept, float("-inf"))  # [n, V]
        kept &= logits >= torch.topk(ranked, top_k, dim=-1).values[:, -1:]  # the k-th largest [n, 1]
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits.masked_fill(~kept, float("-inf")), dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)  # [n, V] renormalised over what min_p / top-k kept
        # Drop a token when the mass before it already reaches top_p (the first token always stays).
        drop_sorted = (probs.cumsum(dim=-1) - probs) >= top_p  # [n, V]
        kept &= ~torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return kept


class SampledLogprobs(NamedTuple):
    full: torch.Tensor  # [n] log p_i: the full tempered distribution (the trainer's support)
    truncated: torch.Tensor  # [n] log q_i = log p_i - log Z: renormalised over K (-inf for i not in K)
    log_kept_mass: torch.Tensor  # [n] log Z <= 0 (0 when nothing is dropped)


def sampled_logprobs(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    *,
    temperature: float,
    top_k: int,
    top_p: float,
    min_p: float = 0.0,
) -> SampledLogprobs:
    """A sampled token's log-prob under the full tempered distribution and under the truncated one it was
    drawn from, and the kept mass: logits [n, V] raw (before the temperature), tokens [n] -> [n] each,
    float32 (float64 for float64 logits). With nothing to drop, truncated == full and log Z == 0."""
    x = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature  # [n, V]
    kept = kept_tokens(x, top_k=top_k, top_p=top_p, min_p=min_p)  # [n, V]
    lse_all = torch.logsumexp(x, dim=-1)  # [n]
    lse_kept = torch.logsumexp(x.masked_fill(~kept, float("-inf")), dim=-1)  # [n]
    picked = x.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)  # [n]
    in_kept = kept.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)  # [n]
    truncated = torch.where(in_kept, picked - lse_kept, torch.full_like(picked, float("-inf")))
    return SampledLogprobs(full=picked - lse_all, truncated=truncated, log_kept_mass=lse_kept - lse_all)
