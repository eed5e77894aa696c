"""On an NVIDIA GPU (skipped elsewhere): the native forward, KV-cache decoder and chunked log-probs on
CUDA against transformers and the full log-softmax, gradient checkpointing, and short tiny-model runs
of the real command on `trainer.device=cuda` with either decoder, fp32 and bf16 autocast.

The CPU suite pins each of these on CPU; here the same equivalences meet CUDA's kernels (sdpa picks
another attention kernel, reductions are ordered differently), so tolerances are 1e-4, not 1e-5."""

import pytest
import torch

from grpo_run import metrics as M
from grpo_run.algo import token_logprobs_and_entropy
from grpo_run.models.loading import enable_checkpointing
from grpo_run.native.decoder import NativeDecoder, native_decoder
from grpo_run.native.forward import NativeSettings, native_completion_logprobs
from grpo_run.native.layers import native_logits
from grpo_run.native.shared_prompt import shared_prompt_logits
from grpo_run.native.weight_casts import WeightCasts
from grpo_run.rollout.decoders import HFDecoder
from grpo_run.rollout.generate import Decoding, SamplingParams, generate_group_completions
from tests.helpers import FAST, read_metrics, run_cli
from tests.native.builders import VOCAB, build, left_padded

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]
CUDA = torch.device("cuda")


def on_cuda(arch: str) -> torch.nn.Module:
    return build(arch).to(CUDA)


def padded_on_cuda(rows: int = 3, width: int = 9):
    ids, mask = left_padded(rows=rows, width=width)
    return ids.to(CUDA), mask.to(CUDA), (mask.cumsum(1) - 1).clamp(min=0).to(CUDA)


@pytest.fixture(autouse=True)
def _no_tf32():
    # fp32 comparisons mean fp32 matmuls: TF32 would round inputs to 10 mantissa bits.
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_native_forward_logits_and_gradients_equal_transformers_on_cuda(arch):
    model = on_cuda(arch).train()
    ids, mask, pos = padded_on_cuda()
    ours = native_logits(model, ids, mask, pos, 4)
    theirs = model(input_ids=ids, attention_mask=mask, position_ids=pos, logits_to_keep=4).logits
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
    weights = torch.randn(ours.shape, generator=torch.Generator().manual_seed(3)).to(CUDA)
    grads = []
    for logits in (ours, theirs):
        model.zero_grad()
        (logits * weights).sum().backward(retain_graph=True)
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-3)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@torch.no_grad()
def test_native_decoder_logits_equal_transformers_on_cuda(arch):
    # Prefill, then 4 decode steps with every row repeated twice and two finished rows dropped.
    model = on_cuda(arch).eval()
    ids, mask, pos = padded_on_cuda(width=7)
    native, hf = NativeDecoder(model, ids.size(1) + 5), HFDecoder(model)
    a, b = native.prefill(ids, mask, pos), hf.prefill(ids, mask, pos)
    torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    for d in (native, hf):
        d.repeat_rows(2)
    attn, next_pos = mask.repeat_interleave(2, 0), pos[:, -1:].repeat_interleave(2, 0) + 1
    tok = a.argmax(-1).repeat_interleave(2, 0)
    for step in range(4):
        if step == 2:
            keep = torch.tensor([1, 2, 5], device=CUDA)
            native.keep_rows(keep), hf.keep_rows(keep)
            attn, next_pos, tok = attn[keep], next_pos[keep], tok[keep]
        attn = torch.cat([attn, torch.ones_like(attn[:, :1])], 1)
        a, b = native.step(tok, attn, next_pos), hf.step(tok, attn, next_pos)
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
        tok, next_pos = (a + torch.arange(a.size(0), device=CUDA)[:, None]).argmax(-1), next_pos + 1


def test_native_and_transformers_sample_alike_on_cuda():
    # The uniforms come from per-prompt CPU generators whatever the device, so both decoders draw the
    # same tokens wherever their probabilities agree to rounding.
    model = on_cuda("qwen2").eval()
    ids, mask, _ = padded_on_cuda(rows=4, width=6)
    params = SamplingParams(max_new_tokens=12, temperature=1.0)
    runs = [
        generate_group_completions(
            model,
            ids,
            mask,
            group_size=3,
            params=params,
            seeds=[5, 6, 7, 8],
            decoding=Decoding(1, 0, make_decoder=native_decoder(model, b)),
        )
        for b in ("native", "hf")
    ]
    assert runs[0].completion_ids.device.type == "cuda"
    assert torch.equal(runs[0].completion_ids, runs[1].completion_ids)
    assert torch.equal(runs[0].completion_mask, runs[1].completion_mask)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_logprobs_equal_the_full_log_softmax_on_cuda(dtype):
    # A SmolLM2-sized vocabulary (49152) in chunks of 256 rows, values and gradients.
    g = torch.Generator().manual_seed(0)
    logits0 = (3 * torch.randn(4, 33, 49152, generator=g)).to(dtype).to(CUDA)  # [N, T, V]
    targets = torch.randint(0, 49152, (4, 33), generator=g).to(CUDA)  # [N, T]
    upstream = torch.randn(4, 33, generator=g).to(CUDA)  # [N, T]
    logits = logits0.clone().requires_grad_(True)
    lp, ent = token_logprobs_and_entropy(logits, targets, 0.7, chunk_size=32)
    (lp * upstream).sum().backward()
    ref_logits = logits0.clone().requires_grad_(True)
    logp = torch.log_softmax(ref_logits.float() / 0.7, dim=-1)  # [N, T, V]
    ref = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    (ref * upstream).sum().backward()
    torch.testing.assert_close(lp, ref, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ent, -(logp.exp() * logp).sum(-1).detach(), atol=1e-4, rtol=1e-5)
    # The gradient is stored in the logits' dtype: 1e-6 plus rounding (fp32: ~10 ulp of the softmax
    # at a gradient of ~1.4, seen on CPU; bf16: 2 ulp of bf16).
    rtol = 1e-5 if dtype == torch.float32 else 1.6e-2
    torch.testing.assert_close(logits.grad.float(), ref_logits.grad.float(), atol=1e-6, rtol=rtol)


def test_completion_logprobs_across_backends_and_bf16_autocast_on_cuda():
    model = on_cuda("llama").eval()
    ids, mask, _ = padded_on_cuda(rows=3, width=6)
    completion = torch.randint(2, VOCAB, (3, 4), generator=torch.Generator().manual_seed(5)).to(CUDA)
    native_s, hf_s = NativeSettings(0.7, 5, backend="native"), NativeSettings(0.7, 5, backend="hf")
    native = native_completion_logprobs(model, ids, mask, completion, settings=native_s, with_entropy=True)
    hf = native_completion_logprobs(model, ids, mask, completion, settings=hf_s, with_entropy=True)
    for a, b in zip(native, hf):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        a, _ = native_completion_logprobs(model, ids, mask, completion, settings=native_s, with_entropy=True)
        b, _ = native_completion_logprobs(model, ids, mask, completion, settings=hf_s, with_entropy=True)
    assert a.dtype == torch.float32 and (a - b).abs().max() < 5e-2  # log-probs here are O(4)


def test_fused_lm_head_equals_logits_first_on_cuda():
    model = on_cuda("llama").train()
    ids, mask, _ = padded_on_cuda(rows=3, width=6)
    completion = torch.randint(2, VOCAB, (3, 4), generator=torch.Generator().manual_seed(5)).to(CUDA)
    kw = dict(with_entropy=True)
    results = []
    for fused in (True, False):
        model.zero_grad(set_to_none=True)
        settings = NativeSettings(0.7, 5, backend="native", fused_head=fused)
        lp, ent = native_completion_logprobs(model, ids, mask, completion, settings=settings, **kw)
        lp.sum().backward()
        results.append((lp.detach(), ent, [p.grad.clone() for p in model.parameters()]))
    (lp, ent, grads), (lp0, ent0, grads0) = results
    torch.testing.assert_close(lp, lp0, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent, ent0, atol=1e-5, rtol=1e-5)
    for a, b in zip(grads, grads0):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_shared_prompt_forward_equals_the_plain_forward_on_cuda(arch):
    from tests.native.builders import micro_batch, plain_logits

    model = on_cuda(arch).train()
    batch = [t.to(CUDA) for t in micro_batch()]
    results = []
    for fn in (plain_logits, shared_prompt_logits):
        model.zero_grad()
        logits = fn(model, *batch)
        logits.square().sum().backward()
        results.append((logits.detach(), [p.grad.clone() for p in model.parameters()]))
    (plain, plain_grads), (shared, shared_grads) = results
    torch.testing.assert_close(shared, plain, atol=1e-4, rtol=1e-4)
    for a, b in zip(shared_grads, plain_grads):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-3)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_casting_weights_once_gives_autocasts_gradients_on_cuda(checkpointing):
    # On CPU the gradients are equal bit for bit (tests/native/test_weight_casts.py); CUDA's embedding
    # backward adds atomically, so rounding.
    from tests.native.builders import micro_batch

    model = on_cuda("llama").train()  # tied LM head
    if checkpointing:
        enable_checkpointing(model)
    prompt_ids, prompt_mask, completion_ids = (t.to(CUDA) for t in micro_batch())

    def grads(casts):
        model.zero_grad(set_to_none=True)
        for mb in (slice(0, 4), slice(4, 7)):  # two micro-batches, one set of casts
            with torch.autocast("cuda", dtype=torch.bfloat16):
                lp, _ = native_completion_logprobs(
                    model,
                    prompt_ids[mb],
                    prompt_mask[mb],
                    completion_ids[mb],
                    settings=NativeSettings(1.0, 3, backend="native", share_prompts=True),
                    weight_casts=casts,
                )
            (lp * torch.linspace(-1.0, 1.0, lp.numel(), device=CUDA).view_as(lp)).sum().backward()
        return {name: p.grad.clone() for name, p in model.named_parameters()}

    expected, got = grads(None), grads(WeightCasts())
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, atol=1e-6, rtol=1e-5, msg=name)


def test_gradient_checkpointing_gives_the_same_gradients_on_cuda():
    def grads(model):
        ids, mask, pos = padded_on_cuda()
        model.zero_grad()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = native_logits(model, ids, mask, pos, 4)
        logits.float().square().sum().backward()
        return [p.grad.clone() for p in model.parameters()]

    model = on_cuda("qwen2").train()
    plain = grads(model)
    enable_checkpointing(model)
    for a, b in zip(plain, grads(model)):  # the embedding's backward adds atomically: rounding only
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize(
    "extra",
    [
        ["backend.decoder=native", "model.autocast_bf16=false"],
        ["backend=plain", "model.autocast_bf16=true", "model.gradient_checkpointing=true"],
    ],
    ids=["native-fp32", "hf-bf16-ckpt"],
)
def test_tiny_run_trains_on_cuda(tmp_path, extra):
    args = [a for a in FAST if a != "trainer.device=cpu"] + [
        "trainer.device=cuda",
        "trainer.max_steps=3",
        "logger=console",
        "logger.console=false",
        *extra,
    ]
    _, run_dir = run_cli(args, tmp_path, timeout=300)
    rows = read_metrics(run_dir)
    steps = [r for r in rows if M.LOSS in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all(torch.isfinite(torch.tensor(r[M.LOSS])) for r in steps)
    assert all(0 < r[M.PEAK_MEM_GB] < 10 for r in steps)  # torch.cuda.max_memory_allocated, GB
    assert (run_dir / "final" / "model.safetensors").exists()
