"""The forward passes of sampling behind one small interface; here transformers' own (`HFDecoder`).

A decoder answers four calls, so the sampling loop in `generate.py` does not know which one runs
(the fast path's `grpo_run/native/decoder.py` is the other):
    prefill(ids [B, P], mask [B, P], positions [B, P]) -> logits of the last column [B, V]
    repeat_rows(k)                                       -> every row's cache repeated k times
    keep_rows(keep [n'])                                 -> only these rows stay in the cache
    step(tokens [n], mask [n, C], positions [n, 1])      -> logits [n, V], after writing column C - 1

A decoder is built per generation call as `make(model, max_len)`, max_len = prompt columns + new tokens.
A decoder that can also hand its rows' cache out and take it back (`ContinuesRows`, the native one)
lets multi-turn episodes continue their cache instead of prefilling the history again (`turns.py`).
"""

import inspect
from typing import Protocol, runtime_checkable

import torch
from transformers import DynamicCache, PreTrainedModel


class Decoder(Protocol):
    def prefill(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor) -> torch.Tensor: ...
    def repeat_rows(self, k: int) -> None: ...
    def keep_rows(self, keep: torch.Tensor) -> None: ...
    def step(self, tokens: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor) -> torch.Tensor: ...


@runtime_checkable
class ContinuesRows(Protocol):
    def export_rows(self, which: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per layer keys and values [k, kv_heads, C, d] of the rows `which` ([n] bool), C = columns written."""
        ...

    def extend(self, cached, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Load `cached` (`generate.CachedRows`) and prefill a chunk after it -> logits [n, V]."""
        ...


def cache_argument(model: PreTrainedModel) -> str:
    """The name of the forward's cache argument: `cache` since transformers renamed `past_key_values`
    (within 5.x; the old name is deprecated there). Releases before the rename take an unknown
    `cache=` into **kwargs and ignore it: every step would decode one token with no history."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


class HFDecoder:
    """transformers' forward with its DynamicCache."""

    def __init__(self, model: PreTrainedModel, max_len: int = 0) -> None:  # the cache grows as it goes
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
