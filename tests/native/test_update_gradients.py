"""The fast path's whole update against transformers' forward: the same gradients and grad norm.

Each piece of `backend=native` (written-out layers, shared-prompt forwards, the LM head fused into the
chunked log-softmax, the lean attention / SwiGLU backwards, the one-op RMSNorm, bf16 weight casts) has
its own equivalence test; this one runs them together through the update itself (`update.training_batch`
and `update.policy_update`, micro-batches and all) at the default run's shape, and compares what the
optimizer would receive: every parameter's gradient and the total grad norm `train/grad_norm` logs. A
memory-saving path whose loss or gradient drifts from the reference (TRL #7063: a fused loss path with
a ~100x larger grad_norm) fails here even where each piece's own test was adjusted along with it.
"""

import pytest
import torch
from transformers import AutoModelForCausalLM

from grpo_run import metrics as M
from grpo_run import update
from grpo_run.algo import compute_advantages
from grpo_run.backend import training_forward
from grpo_run.models.tiny import ensure_tiny_model
from grpo_run.rollout.filtering import loss_mask
from grpo_run.rollout.generate import Rollout, completion_mask_from
from tests.builders import compose_config

CPU = torch.device("cpu")


class RecordingEngine:
    """A one-process `Engine` whose `step` keeps the accumulated gradients and their total norm instead
    of clipping and applying them."""

    rank, world_size, device = 0, 1, CPU

    def __init__(self, model: torch.nn.Module) -> None:
        self.module = model
        self.grads: dict[str, torch.Tensor] = {}
        self.norm = torch.tensor(float("nan"))

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self) -> torch.Tensor:
        params = {n: p for n, p in self.module.named_parameters() if p.requires_grad}
        self.grads = {n: p.grad.detach().clone() for n, p in params.items()}
        self.norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in self.grads.values()]))
        self.module.zero_grad(set_to_none=True)
        return self.norm

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def all_reduce_max(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def broadcast_flag(self, flag: bool) -> bool:
        return flag


def default_run_batch(cfg, vocab: int, eos_id: int, pad_id: int):
    """A rollout at the default run's shape: B = trainer.prompts_per_step prompts of 9 to 23 tokens
    (left-padded), G = grpo.group_size completions each of 1 to generation.max_new_tokens tokens (some
    ending in EOS, some truncated), and 0/1 rewards with two groups all equal (rows the update skips)."""
    b, g, t = cfg.trainer.prompts_per_step, cfg.grpo.group_size, cfg.generation.max_new_tokens
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(9, 24, (b,), generator=gen)  # [B]
    width = int(lengths.max())
    prompt_ids = torch.randint(3, vocab, (b, width), generator=gen)  # [B, P]
    prompt_mask = (torch.arange(width)[None, :] >= width - lengths[:, None]).long()  # [B, P] left padding
    prompt_ids = prompt_ids.masked_fill(prompt_mask == 0, pad_id)
    ids = torch.randint(3, vocab, (b * g, t), generator=gen)  # [N, T]
    ends = torch.randint(0, t + 8, (b * g,), generator=gen)  # [N] past t: no EOS (truncated)
    rows = (ends < t).nonzero().squeeze(1)
    ids[rows, ends[rows]] = eos_id
    mask, truncated = completion_mask_from(ids, eos_id)  # [N, T], [N]
    rollout = Rollout(
        prompt_ids=prompt_ids.repeat_interleave(g, dim=0),
        prompt_mask=prompt_mask.repeat_interleave(g, dim=0),
        completion_ids=ids.masked_fill(mask == 0, pad_id),
        completion_mask=mask,
        truncated=truncated,
    )
    rewards = torch.randint(0, 2, (b, g), generator=gen).float()  # [B, G]
    rewards[0], rewards[3] = 1.0, 0.0  # all correct, all wrong: advantage 0
    return rollout, rewards


def update_gradients(cfg, model: torch.nn.Module, rollout: Rollout, rewards: torch.Tensor) -> RecordingEngine:
    """The default run's update of one step on `rollout` with `cfg`'s training forward; nothing applied."""
    g = cfg.grpo
    advantages = compute_advantages(rewards, g.advantage_mode, g.std_correction, g.advantage_eps).reshape(-1)
    mask = loss_mask(rollout, g.mask_truncated)  # [N, T]
    engine, forward = RecordingEngine(model), training_forward(cfg, CPU)
    run, coefs = update.UpdateSettings.of(cfg), update.StepCoefs(g.beta, g.entropy_coef)
    models = update.UpdateModels(engine, forward, model)
    inputs = update.StepInputs(rollout, advantages, mask)
    batch = update.training_batch(inputs, M.StepMetrics(CPU), run, models, coefs)
    update.policy_update(batch, M.StepMetrics(CPU), run, models, coefs)
    return engine


def spy(monkeypatch, module, name: str) -> list[int]:
    """Count the calls of `module.name` (a fast-path piece the native forward calls)."""
    calls, real = [], getattr(module, name)

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


# Tolerances. float32: both forwards compute the same arithmetic in another order (written-out layers,
# shared prompt columns, the fused head's per-block sums); measured on this batch, the largest gradient
# difference of any parameter is 1.0e-6 of that parameter's largest gradient and the norms agree to
# 1e-7 or better, so 1e-4 per parameter and 1e-5 on the norm leave a margin of 100 for other BLAS
# kernels and thread counts. bf16 autocast: the fast path rounds to bf16 at other points than autocast
# (weights cast once per step, the fused head's logits and their gradient per block), so each gradient
# moves by up to bf16's resolution (measured:
# 1.2% of a parameter's largest gradient, cosine similarity >= 0.99994, norm ratio 1 - 4.8e-5). Both are
# orders of magnitude below any real drift: a loss summed over tokens instead of averaged scales every
# gradient by the token count (~1,000 here), a missing 1/temperature by 1/0.7.
TOLERANCES = {"false": (1e-4, 0.99999, 1e-5), "true": (5e-2, 0.999, 1e-3)}  # per-parameter, cosine, norm


@pytest.mark.parametrize("bf16", ["false", "true"])
def test_native_update_gradients_and_grad_norm_equal_the_plain_forward(_cache_dir, monkeypatch, bf16):
    """The default run's update (B = 8 prompts x G = 8 completions of up to 32 tokens, micro-batches of
    16, per_response, beta 0, temperature 0.7) on the tiny model, float32 and under bf16 autocast:
    backend=native's gradients and grad norm equal backend=plain's to rounding."""
    import grpo_run.native.forward as native_forward

    # padded micro-batches: the pieces counted below (tests/packing/ compares packed ones with these)
    base = ["model=tiny", f"model.autocast_bf16={bf16}", "trainer.device=cpu", "trainer.padding_free=false"]
    native_cfg, plain_cfg = (
        compose_config([*base, "backend=native"]),
        compose_config([*base, "backend=plain"]),
    )
    assert (native_cfg.trainer.prompts_per_step, native_cfg.grpo.group_size) == (8, 8)
    assert (native_cfg.generation.max_new_tokens, native_cfg.trainer.micro_batch_size) == (32, 16)
    model = AutoModelForCausalLM.from_pretrained(ensure_tiny_model(_cache_dir), dtype=torch.float32).train()
    rollout, rewards = default_run_batch(native_cfg, model.config.vocab_size, model.config.eos_token_id, 0)
    fused = spy(monkeypatch, native_forward, "head_token_logprobs")
    shared = spy(monkeypatch, native_forward, "shared_prompt_hidden")
    native = update_gradients(native_cfg, model, rollout, rewards)
    assert len(fused) == len(shared) == 3  # 6 informative groups of 8 rows: 3 micro-batches, every piece on
    plain = update_gradients(plain_cfg, model, rollout, rewards)
    assert len(fused) == 3  # the plain forward never reached the fast path

    per_parameter, cosine, norm = TOLERANCES[bf16]
    assert native.norm.item() == pytest.approx(plain.norm.item(), rel=norm)  # train/grad_norm
    assert native.grads.keys() == plain.grads.keys()
    for name, want in plain.grads.items():
        got = native.grads[name]
        assert want.abs().max() > 0, name  # every parameter takes part in this loss
        assert (got - want).abs().max() <= per_parameter * want.abs().max(), name
        assert torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0) >= cosine, name
