"""G sampled completions per prompt, with the prompt's prefill computed once and shared by its group.

Why our own decode loop rather than `model.generate`:
- the prompt is prefilled once per prompt and its KV cache repeated G times (generate would
  prefill each of the B·G identical rows);
- each prompt's group draws its noise from its own generator, seeded by (seed, step, prompt index),
  so the samples do not depend on how the step's prompts are split over micro-batches or ranks;
- the loop stops as soon as every sequence has produced EOS.
Sampling is by inverse CDF: one uniform per row and step from the group's generator, the token whose
interval of the cumulative distribution holds it (a multinomial draw from p). An exponential race
(argmax of log p − log E over the vocabulary) draws the same distribution but needs V exponentials per
row and step, a large share of a decode step's time on a vocabulary of tens of thousands of tokens.
"""

import functools
from collections.abc import Callable
from dataclasses import dataclass, fields

import torch
from transformers import PreTrainedModel

from grpo_run.algo import token_logprobs
from grpo_run.algo.truncation import kept_tokens, truncates
from grpo_run.rollout.decoders import Decoder, HFDecoder
from grpo_run.safety.stop import stop_requested

# Several large primes to mix (seed, step, prompt index) into one generator seed.
_SEED_MIX = (1_000_003, 10_007)


@dataclass
class SamplingParams:
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    greedy: bool = False


@dataclass(frozen=True)
class Decoding:
    """How a sampling call decodes, the same from one call of an engine to the next: the tokenizer's EOS
    and padding ids, the forward passes, and what the decode loop keeps.

    make_decoder(model, max_len): the forward passes (`decoders.py`): transformers' own by default, the
    fast path's `native/decoder.py` where the native engine runs the loop.
    autocast_bf16: the local engines sample under bf16 autocast (`engines.sampling_mode`: `sample_local`
    and the cached turns read it); `generate_group_completions` itself runs in its caller's autocast.
    with_logprobs: the Rollout carries the decoder's own log-prob of each sampled token
    (`sampler_logprobs`, on the full tempered distribution), as an engine with its own weights (vLLM)
    reports them.
    drop_finished: finished rows leave the decode batch (False: they stay in it and only pad).
    """

    eos_id: int
    pad_id: int
    make_decoder: Callable[[PreTrainedModel, int], Decoder] = HFDecoder
    autocast_bf16: bool = False
    with_logprobs: bool = False
    drop_finished: bool = True


@dataclass
class Rollout:
    """B·G completions, row b·G + g is completion g of prompt b."""

    prompt_ids: torch.Tensor  # [N, P] left-padded
    prompt_mask: torch.Tensor  # [N, P]
    completion_ids: torch.Tensor  # [N, T] pad after the first EOS
    completion_mask: torch.Tensor  # [N, T] 1 up to and including the first EOS
    truncated: torch.Tensor  # [N] bool: hit max_new_tokens without EOS
    # [N, T] float32: the sampler's own log-prob of each sampled token, from engines that report them
    # (vLLM; the local engines when asked, as rollout=async's worker does); 0 past the completion mask.
    # On the trainer's support: log softmax(logits / temperature) over the whole vocabulary, never
    # renormalised over the tokens min_p / top-k / top-p kept, so π_old / π_sampler carries no kept mass
    # (`algo/truncation.py`, docs/algorithm.md). None: the trainer's forward is the sampler (native / hf),
    # so π_sampler = π_old exactly.
    sampler_logprobs: torch.Tensor | None = None
    # [N] long: the version of the weights that sampled each row, the trainer steps they had taken (one
    # optimizer step each with grpo.num_iterations = 1); rollout=async only. None: the current policy.
    policy_version: torch.Tensor | None = None
    # [N, T] long: 1 where the model sampled the token, 0 for observation/tool tokens inside the
    # completion (multi-turn, `rollout/episodes.py`). None: every completion token is the model's.
    trainable_mask: torch.Tensor | None = None

    @property
    def model_mask(self) -> torch.Tensor:
        """[N, T] long: the model's own tokens, what the loss, KL, entropy and length statistics count."""
        if self.trainable_mask is None:
            return self.completion_mask
        return self.completion_mask * self.trainable_mask

    @property
    def completion_lengths(self) -> torch.Tensor:
        return self.model_mask.sum(dim=1)  # [N] model tokens (observations left out)


def group_seed(seed: int, step: int, prompt_index: int) -> int:
    return (seed * _SEED_MIX[0] + step * _SEED_MIX[1] + prompt_index) % (2**63 - 1)


def filter_logits(logits: torch.Tensor, *, top_p: float, top_k: int, min_p: float = 0.0) -> torch.Tensor:
    """Set logits outside the kept set (min_p, then top-k, then top-p: `algo.truncation.kept_tokens`) to
    -inf. logits: [N, V] float32, already divided by the temperature; returned as they are when nothing
    can be dropped."""
    if not truncates(top_k=top_k, top_p=top_p, min_p=min_p):
        return logits
    return logits.masked_fill(~kept_tokens(logits, top_k=top_k, top_p=top_p, min_p=min_p), float("-inf"))


def sample_tokens(
    logits: torch.Tensor, uniforms: torch.Tensor, rows: torch.Tensor, params: SamplingParams
) -> torch.Tensor:
    """logits [n, V] of the still-active rows `rows` [n] (indices into B·G) → next tokens [n], by
    inverse CDF with this step's uniforms [B·G] (`draw_uniforms`)."""
    logits = logits.float()
    if params.greedy:
        return logits.argmax(dim=-1)
    if params.temperature != 1.0:
        logits = logits / params.temperature
    logits = filter_logits(logits, top_p=params.top_p, top_k=params.top_k, min_p=params.min_p)
    return inverse_cdf_sample(logits.softmax(dim=-1), uniforms[rows])


def draw_uniforms(generators: list[torch.Generator], group_size: int, steps: int) -> torch.Tensor:
    """One uniform per row and step, [steps, B·G] float64: group b's G columns from its own generator.

    A group's generator is drawn for all its G rows at every step, finished or not, so a row's samples
    do not depend on whether finished rows leave the batch; drawn for every step at once (one call per
    group per generation instead of per decode step), the numbers are the ones step-by-step draws of G
    give, in the same order (`tests/rollout/test_generate.py`)."""
    return torch.cat([torch.rand(steps, group_size, dtype=torch.float64, generator=g) for g in generators], 1)


def inverse_cdf_sample(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The token i with cdf[i-1] <= u·total < cdf[i]: probs [n, V], u [n] in [0, 1) -> ids [n].

    The CDF is accumulated in float64, so every token owns an interval of its float32 probability's width;
    a token of probability 0 (filtered out) owns an empty interval and is never drawn.
    """
    cdf = probs.double().cumsum(dim=-1)  # [n, V]
    target = (u * cdf[:, -1]).unsqueeze(-1)  # [n, 1] scaled by the total, which float rounding leaves near 1
    return torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp(max=probs.size(-1) - 1)


def completion_mask_from(ids: torch.Tensor, eos_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask up to and including the first EOS; truncated where there is none. ids [N, T]."""
    is_eos = ids == eos_id  # [N, T]
    has_eos = is_eos.any(dim=1)  # [N]
    first = torch.where(has_eos, is_eos.int().argmax(dim=1), ids.size(1))  # [N]
    cols = torch.arange(ids.size(1), device=ids.device)
    mask = (cols[None, :] <= first[:, None]).long()  # [N, T]
    return mask, ~has_eos


def _clone(x: torch.Tensor | None) -> torch.Tensor | None:
    return None if x is None else x.clone()


def inference_rollout(fn: Callable[..., Rollout]) -> Callable[..., Rollout]:
    """Run `fn` under `torch.inference_mode` and hand its Rollout back as ordinary tensors.

    inference_mode skips the autograd bookkeeping that `no_grad` still pays on every op (version
    counters, view tracking), which a decode loop of many small ops pays at every step. Inference tensors
    cannot be saved for a backward pass (the update's embedding saves its ids), hence the copy of the
    rollout's few [N, T] integer tensors when the caller is not in inference mode itself.
    """

    @functools.wraps(fn)
    def wrapper(*args, **kwargs) -> Rollout:
        with torch.inference_mode():
            rollout = fn(*args, **kwargs)
        return outside_inference(rollout)

    return wrapper


def outside_inference(rollout: Rollout) -> Rollout:
    """A rollout made under inference mode as ordinary tensors (copies), unless the caller is in it too."""
    if torch.is_inference_mode_enabled():
        return rollout
    return Rollout(**{f.name: _clone(getattr(rollout, f.name)) for f in fields(Rollout)})


@dataclass
class CachedRows:
    """A decoder's KV cache of several rows after a generation call, kept to continue them (the next
    turn of a multi-turn episode) without prefilling their history again (`rollout/turns.py`).

    Columns may hold holes (a row that finished early, the left padding of a later chunk): `valid`
    says which hold one of the row's tokens, and positions are explicit, so a hole changes nothing.
    The row's last sampled token is not in the cache yet (it was never fed): it is `pending`.
    """

    keys: list[torch.Tensor]  # per layer [n, kv_heads, C, d]
    values: list[torch.Tensor]  # per layer [n, kv_heads, C, d]
    valid: torch.Tensor  # [n, C] bool
    next_pos: torch.Tensor  # [n] long: the position of the pending token
    pending: torch.Tensor  # [n] long


@inference_rollout
def generate_group_completions(
    model: PreTrainedModel,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    *,
    group_size: int,
    params: SamplingParams,
    seeds: list[int],
    decoding: Decoding,
    keep: list[CachedRows] | None = None,
) -> Rollout:
    """prompt_ids [B, P] left-padded → a Rollout of B·G rows. `seeds` has one seed per prompt.

    decoding: the EOS and padding ids, the decoder and what the loop keeps (`Decoding`). keep: a list the
    B·G rows' `CachedRows` is appended to (a decoder with `export_rows`, the native one), to continue
    them later."""
    positions = (prompt_mask.cumsum(dim=1) - 1).clamp(min=0)  # [B, P]
    decoder = decoding.make_decoder(model, prompt_ids.size(1) + params.max_new_tokens)
    logits = decoder.prefill(prompt_ids, prompt_mask, positions)  # [B, V]
    # Share the prompt's prefill across its group: repeat the cache, not the computation.
    decoder.repeat_rows(group_size)
    logits = logits.repeat_interleave(group_size, dim=0)  # [N, V]
    attn = prompt_mask.repeat_interleave(group_size, dim=0)  # [N, P]
    next_pos = positions[:, -1:].repeat_interleave(group_size, dim=0) + 1  # [N, 1]
    completion_ids, logprobs = decode(
        decoder,
        logits,
        attn,
        next_pos,
        uniforms=decode_uniforms(seeds, group_size, params, logits.device),
        params=params,
        decoding=decoding,
        keep=keep,
    )
    completion_mask, truncated = completion_mask_from(completion_ids, decoding.eos_id)
    completion_ids = completion_ids.masked_fill(completion_mask == 0, decoding.pad_id)
    if logprobs is not None:  # 0 past the completion mask, as the Rollout field says
        logprobs = logprobs[:, : completion_ids.size(1)] * completion_mask  # [N, T]
    return Rollout(
        prompt_ids=prompt_ids.repeat_interleave(group_size, dim=0),
        prompt_mask=prompt_mask.repeat_interleave(group_size, dim=0),
        completion_ids=completion_ids,
        completion_mask=completion_mask,
        truncated=truncated,
        sampler_logprobs=logprobs,
    )


def decode_uniforms(
    seeds: list[int], group_size: int, params: SamplingParams, device: torch.device
) -> torch.Tensor | None:
    """The decode loop's noise on `device`: `draw_uniforms` [max_new_tokens, B·G], group b's G rows from a
    generator seeded with seeds[b]; None when decoding greedily, which draws none."""
    if params.greedy:
        return None
    generators = [torch.Generator().manual_seed(s) for s in seeds]
    return draw_uniforms(generators, group_size, params.max_new_tokens).to(device)


def decode(
    decoder: Decoder,
    logits: torch.Tensor,
    attn: torch.Tensor,
    next_pos: torch.Tensor,
    *,
    uniforms: torch.Tensor | None,
    params: SamplingParams,
    decoding: Decoding,
    keep: list[CachedRows] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The decode loop after a prefill: logits [N, V] of each row's last column, attn [N, C] its cache
    columns' mask, next_pos [N, 1] the position of its first new token, uniforms its noise
    (`decode_uniforms`; None: greedy). Returns the sampled ids [N, T] (pad after a row's first EOS,
    T <= max_new_tokens) and, with `decoding.with_logprobs`, [N, max_new_tokens] float32 each sampled
    token's log-prob at the sampling temperature, before min_p / top-k / top-p (the distribution the
    trainer's forward computes: `Rollout.sampler_logprobs`), else None. keep: append the N rows' `CachedRows` (their cache, finished rows'
    included) to it."""
    device, max_new = logits.device, params.max_new_tokens
    n, prompt_len = attn.size()
    logprobs = logits.new_zeros((n, max_new), dtype=torch.float32) if decoding.with_logprobs else None
    # The mask at its final width: step t attends over the first prompt_len + t + 1 columns (a view).
    attn = torch.cat([attn, attn.new_ones(n, max_new)], dim=1)  # [N, C + max_new]
    rows = torch.arange(n, device=device)  # [n] the rows still in the decode batch
    done = torch.zeros(n, dtype=torch.bool, device=device)  # [N] has produced EOS
    out_ids = torch.full((n, max_new), decoding.pad_id, dtype=torch.long, device=device)  # [N, max_new]
    stash = _Stash(n) if keep is not None else None
    steps = 0
    for step in range(max_new):
        tok = sample_tokens(logits, None if uniforms is None else uniforms[step], rows, params)  # [n]
        if not decoding.drop_finished:  # finished rows stay in the batch and only pad
            tok = torch.where(done[rows], torch.full_like(tok, decoding.pad_id), tok)
        out_ids[rows, step] = tok
        if logprobs is not None:  # log softmax(logits / T) at the token, unfiltered: the trainer's support
            logprobs[rows, step] = token_logprobs(logits[:, None], tok[:, None], params.temperature)[:, 0]
        done[rows] |= tok == decoding.eos_id
        steps = step + 1
        # A stop ends the loop here: the rows are cut short, and the caller discards them (safety/stop.py).
        if step == max_new - 1 or bool(done.all()) or stop_requested():
            break
        if decoding.drop_finished and bool(done[rows].any()):
            # Finished rows leave the batch: later steps only pay for the rows still writing.
            finished = done[rows]
            if stash is not None:  # their cache leaves with them: kept for the next turn
                stash.add(decoder, finished, rows, attn[:, : prompt_len + step], next_pos, tok)
            keep_idx = (~finished).nonzero().squeeze(1)  # [n']
            decoder.keep_rows(keep_idx)
            rows, tok, attn, next_pos = rows[keep_idx], tok[keep_idx], attn[keep_idx], next_pos[keep_idx]
        logits = decoder.step(tok, attn[:, : prompt_len + step + 1], next_pos)  # [n, V]
        next_pos = next_pos + 1
    if stash is not None and keep is not None:
        every = torch.ones(rows.numel(), dtype=torch.bool, device=device)
        stash.add(decoder, every, rows, attn[:, : prompt_len + steps - 1], next_pos, tok)
        keep.append(stash.rows())
    return out_ids[:, :steps], logprobs  # [N, T], [N, max_new] or None


class _Stash:
    """Rows' caches as they leave the decode batch, put back in row order at one width (`CachedRows`)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.parts: list[tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor], torch.Tensor]] = []
        self.next_pos = torch.zeros(n, dtype=torch.long)
        self.pending = torch.zeros(n, dtype=torch.long)

    def add(self, decoder, which, rows, attn, next_pos, tok) -> None:
        """which [n] bool of the batch's rows `rows` [n] (their mask attn [n, C], next_pos [n, 1] the
        position of tok [n], their last sampled token, never fed)."""
        keys, values = decoder.export_rows(which)  # per layer [k, kv_heads, C, d]
        self.parts.append((rows[which].cpu(), keys, values, attn[which].bool()))
        self.next_pos[rows[which].cpu()] = next_pos[which, 0].cpu()
        self.pending[rows[which].cpu()] = tok[which].cpu()

    def rows(self) -> CachedRows:
        width = max(p[3].size(1) for p in self.parts)
        first_keys = self.parts[0][1]
        device = self.parts[0][3].device
        keys = [k.new_zeros((self.n, k.size(1), width, k.size(3))) for k in first_keys]
        values = [torch.zeros_like(k) for k in keys]
        valid = torch.zeros((self.n, width), dtype=torch.bool, device=device)
        for idx, part_keys, part_values, part_valid in self.parts:
            cols = part_valid.size(1)
            idx = idx.to(device)
            for i in range(len(keys)):
                keys[i][idx, :, :cols] = part_keys[i]
                values[i][idx, :, :cols] = part_values[i]
            valid[idx, :cols] = part_valid
        return CachedRows(keys, values, valid, self.next_pos.to(device), self.pending.to(device))
