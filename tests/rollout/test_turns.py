"""Multi-turn sampling (grpo_run/rollout/turns.py): the native decoder's cached continuation against a
new prefill of the whole history, on the real tiny model (float32) and its chat template."""

import pytest
import torch

from grpo_run.config.schema import EnvConfig
from grpo_run.data.example import Example
from grpo_run.models.tiny import build_model, build_tokenizer
from grpo_run.native.generation import NativeEngine
from grpo_run.rollout.episodes import ChatTurns, run_episodes
from grpo_run.rollout.generate import SamplingParams
from grpo_run.rollout.turns import CachedTurns, RePrefillTurns, StaleTurns, open_turns
from tests.envs.toy import AlwaysAnswers


@pytest.fixture(scope="module")
def tiny():
    tok = build_tokenizer()
    return tok, build_model(tok, seed=0)


# The random tiny model's greedy token: with it as EOS and a low temperature, turns end at different
# steps (rows leave the decode batch early); with the real EOS every turn is cut at max_new_tokens.
OFTEN = 201


def _engine(tiny, eos=None) -> NativeEngine:
    tok, model = tiny
    return NativeEngine(
        model,
        eos_id=tok.eos_token_id if eos is None else eos,
        pad_id=tok.pad_token_id,
        autocast_bf16=False,
        decoder="native",
        bf16_sampling_copy=False,
    )


def _prompts(tok, questions=("What is 1 + 2?", "What is 17 + 5 + 3?")):
    texts = [
        tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        for q in questions
    ]
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    return enc.input_ids, enc.attention_mask


def _episodes(tiny, engine, *, eos, temperature, greedy=False, max_new=7, max_turns=4, group_size=3):
    tok, _ = tiny
    ids, mask = _prompts(tok)
    return run_episodes(
        engine,
        AlwaysAnswers("ok, go on"),
        ChatTurns(tok, eos),
        [Example("q", "3", "0"), Example("q", "25", "1")],
        ids,
        mask,
        group_size=group_size,
        params=SamplingParams(max_new, temperature=temperature, greedy=greedy),
        seeds=[5, 6],
        limits=EnvConfig(name="toy", max_turns=max_turns, max_total_tokens=120),
        eos_id=eos,
        pad_id=tok.pad_token_id,
    )


class _NoCache:
    """The same engine without `open_turns`: every turn prefills its whole history again."""

    def __init__(self, engine):
        self.engine = engine

    def generate(self, *args, **kwargs):
        return self.engine.generate(*args, **kwargs)


@pytest.mark.parametrize(
    "eos, temperature, greedy",
    [(None, 1.0, True), (None, 1.0, False), (OFTEN, 0.1, False), (OFTEN, 0.15, False)],
    ids=["greedy-cut", "sampled-cut", "sampled-early-eos", "sampled-early-eos-2"],
)
def test_the_cached_continuation_samples_what_a_new_prefill_of_the_history_samples(
    tiny, eos, temperature, greedy
):
    """Several turns (turns cut at max_new_tokens, or rows finishing at different steps and leaving the
    decode batch early; left padding in every chunk): the episodes' tokens are the same with the cache
    continued and with the history prefilled again each turn."""
    eos = tiny[0].eos_token_id if eos is None else eos
    engine = _engine(tiny, eos)
    ids, mask = _prompts(tiny[0])
    assert isinstance(open_turns(engine, ids, mask, group_size=3, pad_id=0), CachedTurns)
    assert isinstance(open_turns(_NoCache(engine), ids, mask, group_size=3, pad_id=0), RePrefillTurns)
    kw = dict(eos=eos, temperature=temperature, greedy=greedy)
    cached = _episodes(tiny, engine, **kw)
    fresh = _episodes(tiny, _NoCache(engine), **kw)
    assert [e.ids for e in cached.episodes] == [e.ids for e in fresh.episodes]
    assert [e.trainable for e in cached.episodes] == [e.trainable for e in fresh.episodes]
    assert max(e.model_turns for e in cached.episodes) >= 3  # the continuation ran, more than once
    if eos == OFTEN:  # episodes of different lengths, turns ended by EOS at different steps
        assert len({len(e.ids) for e in cached.episodes}) > 2


def test_the_continued_cache_gives_the_logits_of_a_full_prefill(tiny):
    """One continuation step by hand: the logits after the chunk equal the logits of the whole history
    prefilled at once (float32, to rounding)."""
    tok, model = tiny
    engine = _engine(tiny)
    ids, mask = _prompts(tok)
    turns = engine.open_turns(ids, mask, group_size=2)
    params = SamplingParams(5, temperature=1.0)
    first = turns.first(params=params, seeds=[1, 2])
    rows = [0, 3]
    histories = []
    for r in rows:
        prompt = first.prompt_ids[r][first.prompt_mask[r].bool()].tolist()
        n = int(first.completion_mask[r].sum())
        histories.append(prompt + first.completion_ids[r, :n].tolist() + [7, 8, 9][: 1 + r % 3])
    greedy = SamplingParams(1, greedy=True)
    out = turns.next(rows, histories, params=greedy, seeds=[3, 4])
    with torch.no_grad():
        for j, h in enumerate(histories):
            logits = model(torch.tensor([h])).logits[0, -1]
            assert out.completion_ids[j, 0] == logits.argmax()
    turns.close()


def test_a_turn_after_a_weight_update_refuses_the_stale_cache(tiny):
    engine = _engine(tiny)
    ids, mask = _prompts(tiny[0])
    turns = engine.open_turns(ids, mask, group_size=1)
    first = turns.first(params=SamplingParams(3), seeds=[1, 2])
    history = first.prompt_ids[0][first.prompt_mask[0].bool()].tolist()
    history += first.completion_ids[0, : int(first.completion_mask[0].sum())].tolist()
    turns.next([0], [history], params=SamplingParams(2), seeds=[9])  # fine before the update
    engine.policy_updated()
    with pytest.raises(StaleTurns, match="weights changed"):
        turns.next([0], [history + [5]], params=SamplingParams(2), seeds=[9])


def test_a_history_that_does_not_continue_the_cache_is_refused(tiny):
    engine = _engine(tiny)
    ids, mask = _prompts(tiny[0])
    turns = engine.open_turns(ids, mask, group_size=1)
    first = turns.first(params=SamplingParams(3), seeds=[1, 2])
    history = first.prompt_ids[1][first.prompt_mask[1].bool()].tolist()
    with pytest.raises(StaleTurns, match="row 1"):
        turns.next([1], [history[:-1] + [5, 5, 5, 5]], params=SamplingParams(2), seeds=[9])
