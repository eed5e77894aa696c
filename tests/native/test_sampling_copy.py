"""The bf16 sampling copy: made only for float32 weights under autocast, equal to the policy rounded to
bf16, refreshed after the policy changes, and generating what the rounded policy itself generates."""

import torch

from grpo_run.models.tiny import build_model, build_tokenizer
from grpo_run.native.sampling_copy import SamplingWeights, wants_bf16_copy
from grpo_run.rollout.generate import Decoding, SamplingParams, generate_group_completions


def test_a_copy_only_for_float32_weights_under_autocast():
    assert wants_bf16_copy(autocast_bf16=True, weight_dtype=torch.float32, enabled=True)
    assert not wants_bf16_copy(autocast_bf16=False, weight_dtype=torch.float32, enabled=True)  # tiny, tests
    assert not wants_bf16_copy(autocast_bf16=True, weight_dtype=torch.bfloat16, enabled=True)  # GPU configs
    assert not wants_bf16_copy(autocast_bf16=True, weight_dtype=torch.float32, enabled=False)
    policy = build_model(build_tokenizer(), seed=0)
    same = SamplingWeights(policy, bf16_copy=False)
    assert same.model() is policy and not same.is_copy


def rounded(policy: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().to(torch.bfloat16) for n, p in policy.named_parameters()}


def test_the_copy_follows_the_policy_after_every_change():
    policy = build_model(build_tokenizer(), seed=0)
    weights = SamplingWeights(policy, bf16_copy=True)
    model = weights.model()
    assert model is not policy and not any(p.requires_grad for p in model.parameters())
    for name, p in model.named_parameters():
        assert p.dtype == torch.bfloat16 and torch.equal(p, rounded(policy)[name])

    with torch.no_grad():  # an optimizer step
        for p in policy.parameters():
            p.add_(0.01 * torch.randn_like(p))
    assert not torch.equal(
        dict(model.named_parameters())["model.embed_tokens.weight"],
        rounded(policy)["model.embed_tokens.weight"],
    )
    weights.mark_stale()
    model = weights.model()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p, rounded(policy)[name], rtol=0, atol=0, msg=name)

    weights.release()  # between generations the copy holds no memory ...
    assert all(p.numel() == 0 for p in model.parameters())
    model = weights.model()  # ... and is rebuilt from the policy when it samples again
    for name, p in model.named_parameters():
        torch.testing.assert_close(p, rounded(policy)[name], rtol=0, atol=0, msg=name)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied


def test_the_copy_generates_what_the_rounded_policy_generates():
    tok = build_tokenizer()
    policy = build_model(tok, seed=1)
    ids = torch.randint(3, 200, (2, 5))
    mask = torch.ones_like(ids)
    params = SamplingParams(max_new_tokens=6, temperature=1.0, top_p=1.0, top_k=0)
    decoding = Decoding(tok.eos_token_id, tok.pad_token_id)
    kwargs = dict(group_size=3, params=params, seeds=[4, 5], decoding=decoding)
    from_copy = generate_group_completions(
        SamplingWeights(policy, bf16_copy=True).model(), ids, mask, **kwargs
    )
    reference = build_model(tok, seed=1).to(torch.bfloat16).eval()
    direct = generate_group_completions(reference, ids, mask, **kwargs)
    assert torch.equal(from_copy.completion_ids, direct.completion_ids)
