"""Sampling the turns of multi-turn episodes: each turn continues its row's token history.

`run_episodes` (`episodes.py`) asks a `TurnSampler` for turn 1 (G rows per prompt, the single-turn call)
and then, turn after turn, for the next turn of the rows still active, each given its whole history
(prompt + every model and observation token so far). Two samplers answer it:
    RePrefillTurns  any engine: each turn is a new `generate` call on the left-padded histories, so its
                    prefill runs again over the prompt and the previous turns (vLLM's prefix cache
                    makes that cheap on its side)
    CachedTurns     a decoder that hands its rows' KV cache out and takes it back (`ContinuesRows`, the
                    native one): each turn prefills only what was appended since the row's last sampled
                    token (that token, the observation, the next assistant opening) after its cache
An engine offers the second through `OpensTurns`; `open_turns` falls back to the first.

The cache is of the weights that sampled the turns: an engine whose weights change while a sampler is
open (`policy_updated`) makes its next turn raise (`StaleTurns`) rather than continue a stale cache.
"""

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Protocol, runtime_checkable

import torch
from transformers import PreTrainedModel

from grpo_run.rollout.decoders import ContinuesRows
from grpo_run.rollout.engines import GenerationEngine, sample_local, sampling_mode
from grpo_run.rollout.generate import (
    CachedRows,
    Decoding,
    Rollout,
    SamplingParams,
    completion_mask_from,
    decode,
    decode_uniforms,
    outside_inference,
)


class StaleTurns(RuntimeError):
    """A turn was asked of a sampler whose cache no longer matches the engine's weights or the history."""


class TurnSampler(Protocol):
    def first(self, *, params: SamplingParams, seeds: list[int]) -> Rollout:
        """Turn 1: G rows per prompt (row b·G + g), the engine's single-turn call with these seeds."""
        ...

    def next(
        self, rows: Sequence[int], histories: Sequence[list[int]], *, params: SamplingParams, seeds: list[int]
    ) -> Rollout:
        """The next turn of `rows` (indices among turn 1's rows, each continued at most once per turn),
        histories[j] the whole token history of rows[j] (prompt ids without padding, then every
        completion id so far); seeds[j] seeds rows[j]. completion_* are the new turn's tokens."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class OpensTurns(Protocol):
    def open_turns(
        self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, *, group_size: int
    ) -> TurnSampler | None:
        """A sampler that continues its rows' cache, or None where this engine cannot (its decoder)."""
        ...


def open_turns(
    engine: GenerationEngine,
    prompt_ids: torch.Tensor,  # [B, P] left-padded
    prompt_mask: torch.Tensor,  # [B, P]
    *,
    group_size: int,
    pad_id: int,
) -> TurnSampler:
    if isinstance(engine, OpensTurns):
        turns = engine.open_turns(prompt_ids, prompt_mask, group_size=group_size)
        if turns is not None:
            return turns
    return RePrefillTurns(engine, prompt_ids, prompt_mask, group_size=group_size, pad_id=pad_id)


def left_padded(
    rows: Sequence[list[int]], pad_id: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists -> (ids [n, W], mask [n, W]), left-padded to the longest."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)  # [n, W]
    mask = torch.zeros((len(rows), width), dtype=torch.long)  # [n, W]
    for k, r in enumerate(rows):
        ids[k, width - len(r) :] = torch.tensor(r, dtype=torch.long)
        mask[k, width - len(r) :] = 1
    return ids.to(device), mask.to(device)


class RePrefillTurns:
    """Every turn a new `generate` call on the histories (any engine)."""

    def __init__(self, engine: GenerationEngine, prompt_ids, prompt_mask, *, group_size: int, pad_id: int):
        self.engine, self.prompt_ids, self.prompt_mask = engine, prompt_ids, prompt_mask
        self.group_size, self.pad_id = group_size, pad_id

    def first(self, *, params: SamplingParams, seeds: list[int]) -> Rollout:
        return self.engine.generate(
            self.prompt_ids, self.prompt_mask, group_size=self.group_size, params=params, seeds=seeds
        )

    def next(self, rows, histories, *, params: SamplingParams, seeds: list[int]) -> Rollout:
        ids, mask = left_padded(histories, self.pad_id, self.prompt_ids.device)
        return self.engine.generate(ids, mask, group_size=1, params=params, seeds=seeds)

    def close(self) -> None:
        pass


class CachedTurns:
    """Each turn continues its rows' KV cache (module docstring). `version` reads the engine's weight
    version: a change after `first` makes the next turn raise `StaleTurns`."""

    def __init__(
        self,
        model: PreTrainedModel,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        *,
        group_size: int,
        decoding: Decoding,
        version: Callable[[], int],
        on_close: Callable[[], None] = lambda: None,
    ) -> None:
        """decoding: the engine's (`Decoding`; its make_decoder must continue rows, `ContinuesRows`)."""
        self.model, self.prompt_ids, self.prompt_mask = model, prompt_ids, prompt_mask
        # A continued turn's decode keeps no log-probs, so the first turn keeps none either (an episode
        # reports them only when every turn has them).
        self.group_size, self.decoding = group_size, replace(decoding, with_logprobs=False)
        self.version, self.on_close = version, on_close
        self.sampled_with: int | None = None
        self.cached: CachedRows | None = None
        self.rows: dict[int, int] = {}  # turn-1 row -> its row in `cached`
        self.tokens: list[list[int]] = []  # [row in cached] the history the cache (and pending) covers

    def first(self, *, params: SamplingParams, seeds: list[int]) -> Rollout:
        keep: list[CachedRows] = []
        out = sample_local(
            self.model,
            self.prompt_ids,
            self.prompt_mask,
            group_size=self.group_size,
            params=params,
            seeds=seeds,
            decoding=self.decoding,
            keep=keep,
        )
        self.sampled_with = self.version()
        self.cached = keep[0]
        prompts = [row[m.bool()].tolist() for row, m in zip(out.prompt_ids, out.prompt_mask, strict=True)]
        self._remember(list(range(len(prompts))), prompts, out)
        return out

    def _remember(self, rows: list[int], before: list[list[int]], out: Rollout) -> None:
        lengths = out.completion_mask.sum(1).tolist()
        ids = out.completion_ids.tolist()
        self.rows = {r: j for j, r in enumerate(rows)}
        self.tokens = [h + ids[j][: lengths[j]] for j, h in enumerate(before)]

    def next(self, rows, histories, *, params: SamplingParams, seeds: list[int]) -> Rollout:
        if self.cached is None or self.sampled_with != self.version():
            raise StaleTurns("the engine's weights changed since this episode's first turn")
        chunks = []
        for r, history in zip(rows, histories, strict=True):
            covered = self.tokens[self.rows[r]]
            if history[: len(covered)] != covered:
                raise StaleTurns(f"row {r}'s history does not continue the tokens its cache holds")
            chunks.append(history[len(covered) - 1 :])  # from the pending token on
        index = torch.tensor([self.rows[r] for r in rows], device=self.cached.valid.device)
        with (
            sampling_mode(self.model, self.prompt_ids.device, self.decoding.autocast_bf16),
            torch.inference_mode(),
        ):
            out, self.cached = self._continue(index, chunks, params, seeds)
        out = outside_inference(out)
        self._remember(list(rows), [list(h) for h in histories], out)
        return out

    def _continue(
        self, index: torch.Tensor, chunks: list[list[int]], params: SamplingParams, seeds: list[int]
    ) -> tuple[Rollout, CachedRows]:
        c = self.cached
        assert c is not None
        state = CachedRows(
            [k[index] for k in c.keys],
            [v[index] for v in c.values],
            c.valid[index],
            c.next_pos[index],
            c.pending[index],
        )
        d = self.decoding
        ids, mask = left_padded(chunks, d.pad_id, self.prompt_ids.device)  # [n, S]
        positions = state.next_pos[:, None] + (mask.cumsum(dim=1) - 1).clamp(min=0)  # [n, S]
        decoder = d.make_decoder(self.model, state.valid.size(1) + ids.size(1) + params.max_new_tokens)
        assert isinstance(decoder, ContinuesRows)
        logits = decoder.extend(state, ids, mask, positions)  # [n, V]
        keep: list[CachedRows] = []
        completion_ids, _ = decode(
            decoder,
            logits,
            torch.cat([state.valid.long(), mask], dim=1),
            positions[:, -1:] + 1,
            uniforms=decode_uniforms(seeds, 1, params, logits.device),
            params=params,
            decoding=d,
            keep=keep,
        )
        completion_mask, truncated = completion_mask_from(completion_ids, d.eos_id)
        out = Rollout(
            prompt_ids=ids,
            prompt_mask=mask,
            completion_ids=completion_ids.masked_fill(completion_mask == 0, d.pad_id),
            completion_mask=completion_mask,
            truncated=truncated,
        )
        return out, keep[0]

    def close(self) -> None:
        self.cached = None
        self.on_close()
