"""LoRA through the real PEFT (models/lora.py): the adapter switch, what trains, and that every forward the run
uses (transformers', the native training forward, the native and hf decoders, the merged bf16 sampling
copy) computes with the current adapter."""

import copy

import pytest
import torch
from peft.tuners.lora import LoraLayer

from grpo_run.config.schema import LoraConfig
from grpo_run.config.validation import ConfigError
from grpo_run.engine.single import SingleProcessEngine, load_weights, save_weights
from grpo_run.models import lora
from grpo_run.models.loading import enable_checkpointing
from grpo_run.native.decoder import NativeDecoder
from grpo_run.native.forward import NativeSettings, native_completion_logprobs
from grpo_run.rollout.decoders import HFDecoder
from grpo_run.rollout.generate import Decoding, SamplingParams, generate_group_completions
from tests.native.builders import build, left_padded

DECODERS = {"native": NativeDecoder, "hf": HFDecoder}

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def adapted(arch: str = "qwen2", **kwargs) -> lora.LoraPolicy:
    model = build(arch)
    cfg = LoraConfig(enabled=True, r=4, alpha=8.0, **kwargs)
    return lora.wrap(model, cfg, lora.resolve_targets(lora.adaptable_linear_names(model), cfg.target_modules))


def engine_for(model: torch.nn.Module, lr: float = 1e-2) -> SingleProcessEngine:
    return SingleProcessEngine(
        model,
        lr=lr,
        weight_decay=0.0,
        betas=(0.9, 0.99),
        lr_factor=lambda _: 1.0,
        max_grad_norm=1.0,
        device=torch.device("cpu"),
    )


def logits(model: torch.nn.Module) -> torch.Tensor:
    ids, mask = left_padded()
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    return model(input_ids=ids, attention_mask=mask, position_ids=pos).logits


def one_update(model: torch.nn.Module, engine: SingleProcessEngine) -> None:
    model.train()
    out = logits(model)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(5))
    engine.backward((out * weights).mean())
    engine.step()


def randomise_adapter(policy: lora.LoraPolicy, scale: float = 0.3) -> None:
    """A trained-looking adapter (PEFT starts B at zero, where adapted and base outputs coincide)."""
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in policy.model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * scale)


def base_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" not in n}


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_adapter_disabled_is_the_base_model_and_an_update_moves_only_the_adapter(arch):
    base = build(arch)
    policy = adapted(arch)
    model = policy.model
    with torch.no_grad():
        expected = logits(base)
        # Fresh adapter (B = 0): enabled and disabled both give the base model's logits, bit for bit.
        assert torch.equal(logits(model), expected)
        with policy.adapter_disabled() as reference:
            assert reference is model
            assert torch.equal(logits(reference), expected)
    before = base_weights(model)
    engine = engine_for(model)
    one_update(model, engine)
    with torch.no_grad():
        assert not torch.allclose(logits(model), expected, atol=1e-4)  # the adapter learned something
        with policy.adapter_disabled() as reference:
            assert torch.equal(logits(reference), expected)  # the reference never moves
    after = base_weights(model)
    assert after.keys() == before.keys()
    for name in before:
        assert torch.equal(before[name], after[name]), name


def test_only_the_adapter_trains_and_reaches_the_optimizer():
    policy = adapted()
    model = policy.model
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    # every targeted projection of every layer got its A and B: 2 layers x 7 projections x 2
    assert len(trainable) == 2 * len(TARGETS) * 2
    engine = engine_for(model)
    in_optimizer = {id(p) for group in engine.optimizer.param_groups for p in group["params"]}
    assert in_optimizer == {id(p) for p in model.parameters() if p.requires_grad}
    one_update(model, engine)
    assert len(engine.optimizer.state) == len(trainable)  # AdamW moments for the adapter alone
    count, total = policy.trainable_parameters()
    assert count == sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert total == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize(("fused_head", "share_prompts"), [(False, False), (True, True)])
def test_native_training_forward_computes_with_the_adapter(arch, fused_head, share_prompts):
    policy = adapted(arch)
    randomise_adapter(policy)
    model = policy.model.train()
    ids, mask = left_padded(rows=2, width=6)
    ids, mask = ids.repeat_interleave(2, 0), mask.repeat_interleave(2, 0)  # groups of 2 rows share a prompt
    completion = torch.randint(2, 64, (4, 5), generator=torch.Generator().manual_seed(2))
    kwargs = dict(with_entropy=True)

    def settings(backend: str, share: bool = False) -> NativeSettings:
        return NativeSettings(0.9, 3, backend=backend, share_prompts=share, fused_head=fused_head)

    native, _ = native_completion_logprobs(
        model, ids, mask, completion, settings=settings("native", share_prompts), **kwargs
    )
    # The PeftModel itself, through transformers' forward: what PEFT users run.
    hf, _ = native_completion_logprobs(
        policy.peft_model, ids, mask, completion, settings=settings("hf"), **kwargs
    )
    torch.testing.assert_close(native, hf, atol=1e-5, rtol=1e-5)
    with policy.adapter_disabled():
        base, _ = native_completion_logprobs(
            model, ids, mask, completion, settings=settings("native"), **kwargs
        )
    assert (native - base).abs().max() > 1e-2  # the adapter changes the log-probs: it was not skipped
    # Gradients reach the adapter through the native forward, and equal transformers' forward's.
    grads = []
    for backend, m in (("native", model), ("hf", policy.peft_model)):
        model.zero_grad()
        share = share_prompts and backend == "native"
        lp, _ = native_completion_logprobs(
            m, ids, mask, completion, settings=settings(backend, share), **kwargs
        )
        lp.sum().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad})
    for name, grad in grads[0].items():
        torch.testing.assert_close(grad, grads[1][name], atol=1e-5, rtol=1e-4, msg=name)


def greedy(model: torch.nn.Module, backend: str) -> torch.Tensor:
    ids, mask = left_padded(rows=3, width=6)
    rollout = generate_group_completions(
        model,
        ids,
        mask,
        group_size=2,
        params=SamplingParams(max_new_tokens=8, greedy=True),
        seeds=[1, 2, 3],
        decoding=Decoding(1, 0, make_decoder=DECODERS[backend]),
    )
    return rollout.completion_ids


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@torch.no_grad()
def test_every_decoder_samples_with_the_current_adapter(arch):
    policy = adapted(arch)
    model = policy.model
    with policy.adapter_disabled():
        base_tokens = greedy(model, "hf")
    randomise_adapter(policy, scale=0.5)
    expected = greedy(policy.peft_model, "hf")  # transformers' forward of the PeftModel
    assert not torch.equal(expected, base_tokens)  # the adapter changes what greedy decoding writes
    assert torch.equal(greedy(model, "native"), expected)
    assert torch.equal(greedy(model, "hf"), expected)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@torch.no_grad()
def test_the_merged_bf16_sampling_copy_follows_the_adapter_after_every_step(arch):
    """`MergedSamplingWeights`: plain projections holding bf16(W + (alpha/r)·B·A), rebuilt from the current
    adapter on `mark_stale` (and only then), so the native decoder packs them and samples from the adapter."""
    policy = adapted(arch)
    model = policy.model
    randomise_adapter(policy, scale=0.5)
    sampling = lora.MergedSamplingWeights(policy)

    def expected() -> dict[str, torch.Tensor]:
        merged = copy.deepcopy(policy.peft_model).merge_and_unload()  # PEFT's own merge, in float32
        return {n: p.to(torch.bfloat16) for n, p in merged.named_parameters()}

    def check(copy_model: torch.nn.Module) -> None:
        want = expected()
        got = dict(copy_model.named_parameters())
        assert got.keys() == want.keys()
        for name in want:
            assert torch.equal(got[name], want[name]), name

    first = sampling.model()
    assert not any(isinstance(m, LoraLayer) for m in first.modules())  # plain nn.Linear projections
    check(first)
    # The same tokens as the PeftModel itself sampling in bf16 (greedy, merged in float32 first).
    assert torch.equal(
        greedy(first, "native"),
        greedy(copy.deepcopy(policy.peft_model).merge_and_unload().to(torch.bfloat16), "native"),
    )
    before = {n: p.clone() for n, p in first.named_parameters()}
    randomise_adapter(policy, scale=0.9)  # an optimizer step, not yet announced: the copy is unchanged
    assert all(torch.equal(p, before[n]) for n, p in sampling.model().named_parameters())
    sampling.mark_stale()  # what the trainer calls after every optimizer step
    check(sampling.model())
    assert any(not torch.equal(p, before[n]) for n, p in sampling.model().named_parameters())
    sampling.release()  # freed after sampling: rebuilt from the current adapter at the next use
    randomise_adapter(policy, scale=0.2)
    check(sampling.model())
    assert model is policy.model  # the policy itself is never merged


@pytest.mark.parametrize("backend", ["native", "hf"])
def test_gradients_reach_the_adapter_with_gradient_checkpointing(backend):
    """PEFT's pitfall: with checkpointing and a frozen embedding, no input of a checkpointed layer requires
    grad and (reentrant) the adapters get none. The gradients must equal those without checkpointing."""
    grads = []
    for checkpointing in (False, True):
        model = build("llama")
        if checkpointing:
            enable_checkpointing(model)
        cfg = LoraConfig(enabled=True, r=4, alpha=8.0)
        policy = lora.wrap(
            model, cfg, lora.resolve_targets(lora.adaptable_linear_names(model), ["all-linear"])
        )
        randomise_adapter(policy)
        model = policy.model.train()
        ids, mask = left_padded(rows=3, width=6)
        completion = torch.randint(2, 64, (3, 4), generator=torch.Generator().manual_seed(2))
        lp, _ = native_completion_logprobs(
            model if backend == "native" else policy.peft_model,
            ids,
            mask,
            completion,
            settings=NativeSettings(1.0, 8, backend=backend),
        )
        lp.sum().backward()
        named = {n: p for n, p in model.named_parameters() if p.requires_grad}
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in named.values())
        grads.append({n: p.grad for n, p in named.items()})
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, atol=1e-6, rtol=1e-5, msg=name)


def test_trainable_only_weights_file_round_trips_and_refuses_a_mismatch(tmp_path):
    policy = adapted()
    randomise_adapter(policy)
    file = tmp_path / "model.safetensors"
    save_weights(policy.model, file)
    other = adapted()
    load_weights(other.model, file, torch.device("cpu"))
    for (name, a), (_, b) in zip(policy.model.named_parameters(), other.model.named_parameters()):
        assert torch.equal(a, b), name
    fewer = adapted(target_modules=["q_proj"])
    with pytest.raises(RuntimeError, match="trainable weights do not match"):
        load_weights(fewer.model, file, torch.device("cpu"))


def test_target_modules_resolve_by_suffix_and_a_name_matching_nothing_is_a_config_error():
    names = lora.adaptable_linear_names(build("llama"))
    assert "lm_head" not in names  # never adapted: the native forward reads the head's weight directly
    assert lora.resolve_targets(names, ["all-linear"]) == names
    assert lora.resolve_targets(names, ["self_attn.q_proj", "down_proj"]) == [
        n for n in names if n.endswith(("q_proj", "down_proj"))
    ]
    with pytest.raises(ConfigError) as err:
        lora.resolve_targets(names, ["q_proj", "query"])
    message = str(err.value)
    assert "lora.target_modules" in message and "'query'" in message
    for name in TARGETS:
        assert name in message
    with pytest.raises(ConfigError, match="lora.target_modules"):
        lora.resolve_targets(names, ["lm_head"])


def test_the_adapter_starts_from_the_seed_whatever_drew_from_the_global_generator_before():
    """A run that first builds the tiny model's cache draws from torch's generator before the adapter is
    made; its adapter (and so the whole run) must still be that of a run that found the cache built."""
    cfg = LoraConfig(enabled=True, r=4, alpha=8.0)
    starts = []
    for draws in (0, 5):
        model = build("qwen2")
        torch.manual_seed(123)
        torch.rand(draws)
        names = lora.resolve_targets(lora.adaptable_linear_names(model), cfg.target_modules)
        policy = lora.wrap(model, cfg, names, seed=3)
        starts.append({n: p.clone() for n, p in policy.model.named_parameters() if p.requires_grad})
        after = torch.rand(1)
        torch.manual_seed(123)
        torch.rand(draws)
        assert torch.equal(after, torch.rand(1))  # the global generator is left where it was
    assert all(torch.equal(starts[0][n], starts[1][n]) for n in starts[0])
    assert any(p.abs().max() > 0 for p in starts[0].values())
