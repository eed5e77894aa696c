"""The group sampler: greedy equals transformers' generate, dropping finished rows changes nothing,
samples do not depend on how prompts are batched, and the mask ends at the first EOS."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpo_run.algo import token_logprobs
from grpo_run.algo.truncation import sampled_logprobs
from grpo_run.models.forward import completion_logprobs, concatenated
from grpo_run.models.tiny import ensure_tiny_model
from grpo_run.native.decoder import NativeDecoder
from grpo_run.rollout.generate import (
    Decoding,
    SamplingParams,
    completion_mask_from,
    draw_uniforms,
    filter_logits,
    generate_group_completions,
    inverse_cdf_sample,
)


@pytest.fixture(scope="module")
def tiny(_cache_dir):
    path = ensure_tiny_model(_cache_dir)
    tok = AutoTokenizer.from_pretrained(path)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    return model, tok


def prompts(tok, questions):
    texts = [
        tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        for q in questions
    ]
    return tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)


def run(model, tok, enc, *, g, params, seeds, drop=True, eos=None, **decoding):
    """decoding: `Decoding`'s other fields (make_decoder, with_logprobs)."""
    eos_id = tok.eos_token_id if eos is None else eos
    return generate_group_completions(
        model,
        enc.input_ids,
        enc.attention_mask,
        group_size=g,
        params=params,
        seeds=seeds,
        decoding=Decoding(eos_id, tok.pad_token_id, drop_finished=drop, **decoding),
    )


def test_greedy_matches_transformers_generate(tiny):
    model, tok = tiny
    enc = prompts(tok, ["What is 2 + 3?", "hi", "Tom has 12 apples and buys 7 more."])
    ours = run(model, tok, enc, g=2, params=SamplingParams(max_new_tokens=12, greedy=True), seeds=[1, 2, 3])
    ref = model.generate(
        enc.input_ids.repeat_interleave(2, 0),
        attention_mask=enc.attention_mask.repeat_interleave(2, 0),
        do_sample=False,
        max_new_tokens=12,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )[:, enc.input_ids.size(1) :]
    width = ours.completion_ids.size(1)
    assert torch.equal(
        ours.completion_ids, ref[:, :width].masked_fill(ours.completion_mask == 0, tok.pad_token_id)
    )


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_new_tokens=16, temperature=0.5),
        SamplingParams(max_new_tokens=16, top_p=0.9, top_k=50),
    ],
)
def test_dropping_finished_rows_gives_the_same_samples(tiny, params):
    model, tok = tiny
    enc = prompts(tok, ["What is 2 + 3?", "hi"])
    # Use the model's most frequent token as "EOS" so that rows finish at different steps.
    free = run(model, tok, enc, g=4, params=params, seeds=[5, 6], drop=False, eos=-1)
    eos = int(free.completion_ids.flatten().mode().values)
    plain = run(model, tok, enc, g=4, params=params, seeds=[5, 6], drop=False, eos=eos)
    dropped = run(model, tok, enc, g=4, params=params, seeds=[5, 6], drop=True, eos=eos)
    lengths = plain.completion_mask.sum(1)
    assert lengths.min() < lengths.max()  # rows really left the batch at different steps
    assert torch.equal(plain.completion_ids, dropped.completion_ids)
    assert torch.equal(plain.completion_mask, dropped.completion_mask)


def test_samples_do_not_depend_on_batching(tiny):
    model, tok = tiny
    params = SamplingParams(max_new_tokens=10)
    both = run(
        model, tok, prompts(tok, ["What is 2 + 3?", "hello there"]), g=3, params=params, seeds=[11, 12]
    )
    second = run(model, tok, prompts(tok, ["hello there"]), g=3, params=params, seeds=[12])
    assert torch.equal(both.completion_ids[3:, : second.completion_ids.size(1)], second.completion_ids)


def test_inference_mode_rollout_is_ordinary_tensors_with_the_same_samples(tiny):
    """Decoding runs under inference_mode; the rollout comes back as ordinary tensors (the update's
    embedding saves the ids for backward, which an inference tensor refuses) with the samples that the
    same loop gives under no_grad."""
    model, tok = tiny
    enc = prompts(tok, ["What is 2 + 3?", "hi"])
    params = SamplingParams(max_new_tokens=10, temperature=1.0)
    ours = run(model, tok, enc, g=3, params=params, seeds=[5, 6])
    with torch.no_grad():
        plain = generate_group_completions.__wrapped__(
            model,
            enc.input_ids,
            enc.attention_mask,
            group_size=3,
            params=params,
            seeds=[5, 6],
            decoding=Decoding(tok.eos_token_id, tok.pad_token_id),
        )
    for name in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "truncated"):
        assert not getattr(ours, name).is_inference(), name
        assert torch.equal(getattr(ours, name), getattr(plain, name)), name
    ids = torch.cat([ours.prompt_ids, ours.completion_ids], dim=1)
    model.get_input_embeddings()(ids).sum().backward()  # raises on an inference tensor
    assert model.get_input_embeddings().weight.grad is not None
    model.zero_grad(set_to_none=True)
    with torch.inference_mode():  # a caller already in inference mode gets the tensors as they are
        assert run(model, tok, enc, g=3, params=params, seeds=[5, 6]).completion_ids.is_inference()


def test_completion_mask_ends_at_the_first_eos():
    ids = torch.tensor([[5, 9, 2, 7], [5, 6, 7, 8], [2, 2, 3, 4]])
    mask, truncated = completion_mask_from(ids, eos_id=2)
    # row 0: EOS at 2 → tokens 0..2 count; row 1: no EOS → all count, truncated; row 2: EOS first.
    assert mask.tolist() == [[1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0]]
    assert truncated.tolist() == [False, True, False]


def test_top_p_keeps_the_smallest_set_reaching_p():
    # probabilities 0.5, 0.3, 0.2: top_p 0.7 keeps the first two (0.5 < 0.7, 0.8 >= 0.7).
    logits = torch.tensor([[0.5, 0.3, 0.2]]).log()
    kept = filter_logits(logits, top_p=0.7, top_k=0).isfinite()
    assert kept.tolist() == [[True, True, False]]
    assert filter_logits(logits, top_p=1.0, top_k=1).isfinite().tolist() == [[True, False, False]]


def test_inverse_cdf_sampling_by_hand():
    # probs [0.2, 0, 0.5, 0.3] -> cdf [0.2, 0.2, 0.7, 1.0]; token i owns [cdf[i-1], cdf[i]).
    probs = torch.tensor([[0.2, 0.0, 0.5, 0.3]]).expand(6, 4)
    u = torch.tensor([0.0, 0.1, 0.25, 0.69, 0.71, 0.999], dtype=torch.float64)
    # Token 1's interval [0.2, 0.2) is empty: 0.25 falls in token 2's [0.2, 0.7).
    assert inverse_cdf_sample(probs, u).tolist() == [0, 0, 2, 2, 3, 3]


def test_inverse_cdf_sampling_draws_each_token_with_its_probability():
    probs = torch.tensor([0.05, 0.0, 0.6, 0.25, 0.1])
    u = torch.rand(200_000, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    counts = torch.bincount(inverse_cdf_sample(probs.expand(u.numel(), 5), u), minlength=5)
    assert counts[1] == 0  # probability 0 is never drawn
    # 200k draws: the standard error of a frequency is at most 0.0011; 0.005 is > 4 of them.
    torch.testing.assert_close(counts.double() / u.numel(), probs.double(), atol=5e-3, rtol=0)


def test_uniforms_drawn_at_once_are_the_step_by_step_draws():
    # Group b's G uniforms of step t are its generator's draws t·G .. t·G + G - 1, as when each decode
    # step drew G of them (how the loop drew before drawing every step at once).
    seeds, group_size, steps = [5, 6, 7], 4, 9
    at_once = draw_uniforms([torch.Generator().manual_seed(s) for s in seeds], group_size, steps)  # [9, 12]
    gens = [torch.Generator().manual_seed(s) for s in seeds]
    by_step = torch.stack(
        [
            torch.cat([torch.rand(group_size, dtype=torch.float64, generator=g) for g in gens])
            for _ in range(steps)
        ]
    )
    assert at_once.shape == (steps, len(seeds) * group_size) and at_once.dtype == torch.float64
    assert torch.equal(at_once, by_step)


def test_a_decode_steps_logprob_by_hand():
    """The decode loop's per-token call (logits [n, 1, V], tokens [n, 1]): the tempered distribution,
    top-k / top-p never enter, as the trainer's."""
    # logits [0, ln 3]: p = [1/4, 3/4]; token 1 -> ln(3/4) = -0.28768, token 0 -> ln(1/4) = -1.38629.
    logits = torch.tensor([[0.0, float(torch.tensor(3.0).log())]])

    def step(tok: int, temperature: float) -> float:
        return token_logprobs(logits[:, None], torch.tensor([[tok]]), temperature)[0, 0].item()

    assert step(1, 1.0) == pytest.approx(-0.287682, abs=1e-6)
    assert step(0, 1.0) == pytest.approx(-1.386294, abs=1e-6)
    # T = 0.5 doubles the logits: [0, ln 9], p = [1/10, 9/10]; token 1 -> ln(0.9) = -0.105361.
    assert step(1, 0.5) == pytest.approx(-0.105361, abs=1e-6)


@pytest.mark.parametrize("decoder", ["hf", "native"])
@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_new_tokens=16, temperature=0.7),
        SamplingParams(max_new_tokens=16, temperature=1.0, top_p=0.9, top_k=50),
    ],
)
def test_decoder_logprobs_equal_the_training_forward_and_change_no_sample(tiny, decoder, params):
    """with_logprobs: each sampled token's log-prob as the decode step computed it equals the training
    forward's on the whole sequence (float32: rounding only), 0 past the mask; the samples are the same."""
    model, tok = tiny
    enc = prompts(tok, ["What is 2 + 3?", "hi", "Tom has 12 apples and buys 7 more."])
    free = run(model, tok, enc, g=4, params=params, seeds=[5, 6, 7], drop=False, eos=-1)
    eos = int(free.completion_ids.flatten().mode().values)  # rows finish at different steps
    make = {} if decoder == "hf" else {"make_decoder": NativeDecoder}
    plain = run(model, tok, enc, g=4, params=params, seeds=[5, 6, 7], eos=eos, **make)
    got = run(model, tok, enc, g=4, params=params, seeds=[5, 6, 7], eos=eos, with_logprobs=True, **make)
    assert plain.sampler_logprobs is None
    assert torch.equal(got.completion_ids, plain.completion_ids)
    lengths = got.completion_mask.sum(1)
    assert lengths.min() < lengths.max()
    with torch.no_grad():
        want, _ = completion_logprobs(
            model,
            got.prompt_ids,
            got.prompt_mask,
            got.completion_ids,
            temperature=params.temperature,
            chunk_size=64,
        )  # [N, T]
    mask = got.completion_mask.bool()
    assert got.sampler_logprobs.dtype == torch.float32 and got.sampler_logprobs.shape == want.shape
    torch.testing.assert_close(got.sampler_logprobs[mask], want[mask], atol=1e-5, rtol=0)
    assert torch.all(got.sampler_logprobs[~mask] == 0)


def trainer_logits(model, rollout) -> torch.Tensor:
    """The training forward's logits at every completion position: [N, T, V] (raw, before temperature)."""
    ids, attn, pos, cols = concatenated(rollout.prompt_ids, rollout.prompt_mask, rollout.completion_ids)
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=attn, position_ids=pos).logits[:, cols].float()


def outside(ratio: torch.Tensor) -> float:
    """The share of ratios outside [0.9, 1.1] (TRL #7269's measure)."""
    return ((ratio < 0.9) | (ratio > 1.1)).double().mean().item()


@pytest.mark.parametrize("decoder", ["hf", "native"])
@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_new_tokens=16, temperature=1.0, top_p=0.8),
        SamplingParams(max_new_tokens=16, temperature=0.7, top_k=8, min_p=0.05),
    ],
)
def test_truncated_sampling_reports_logprobs_on_the_trainer_support(tiny, decoder, params):
    """Under min_p / top-k / top-p each reported log-prob is log p_i of the full tempered distribution (the
    trainer's pi_old), not log(p_i / Z) renormalised over the kept tokens: a trainer equal to the sampler
    gives the mismatch ratio exp(log pi_old - log pi_sampler) = 1 on every token, where the renormalised
    log-probs would give Z, the kept mass (TRL #6789). Every sampled token lies in the kept set."""
    model, tok = tiny
    enc = prompts(tok, ["What is 2 + 3?", "hi", "Tom has 12 apples and buys 7 more."])
    make = {} if decoder == "hf" else {"make_decoder": NativeDecoder}
    got = run(model, tok, enc, g=4, params=params, seeds=[5, 6, 7], with_logprobs=True, **make)
    mask = got.completion_mask.bool()  # [N, T]
    logits = trainer_logits(model, got)[mask]  # [M, V] the sampled positions
    tokens = got.completion_ids[mask]  # [M]
    knobs = dict(top_k=params.top_k, top_p=params.top_p, min_p=params.min_p)
    ref = sampled_logprobs(logits, tokens, temperature=params.temperature, **knobs)  # [M] each
    sampler = got.sampler_logprobs[mask]  # [M]
    assert torch.isfinite(ref.truncated).all()  # drawn from the kept set only
    # The tiny model's flat distributions lose a real share of their mass to truncation (mean Z < 0.9),
    # so reporting the renormalised log-probs instead would fail below by far.
    assert ref.log_kept_mass.exp().mean() < 0.9
    torch.testing.assert_close(sampler, ref.full, atol=1e-5, rtol=0)
    ratio = (ref.full - sampler).exp()  # pi_old / pi_sampler, the trainer's forward being the sampler
    torch.testing.assert_close(ratio, torch.ones_like(ratio), atol=1e-4, rtol=0)
    assert outside(ratio) == 0.0
    # Against the renormalised log-probs the ratio would be Z itself on every token.
    torch.testing.assert_close((ref.full - ref.truncated).exp(), ref.log_kept_mass.exp(), atol=1e-5, rtol=0)
    assert outside(ref.log_kept_mass.exp()) > 0.5


def test_min_p_drops_the_improbable_tokens():
    # p = softmax([2, 1, 0, -1]) = [0.643914, 0.236883, 0.087144, 0.032059]; min_p = 0.1 drops
    # p < 0.064391 (token 3); min_p = 0.2 drops p < 0.128783 (tokens 2 and 3).
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    assert filter_logits(logits, top_p=1.0, top_k=0, min_p=0.1).isfinite().tolist() == [
        [True, True, True, False]
    ]
    assert filter_logits(logits, top_p=1.0, top_k=0, min_p=0.2).isfinite().tolist() == [
        [True, True, False, False]
    ]


def test_nothing_to_drop_leaves_the_logits_untouched():
    """top_p 1, top_k 0, min_p 0: the sampler's logits, hence its samples and log-probs, are today's."""
    logits = torch.randn(3, 50)
    assert filter_logits(logits, top_p=1.0, top_k=0) is logits
    assert filter_logits(logits, top_p=1.0, top_k=0, min_p=0.0) is logits
