"""The fast path: hand-written forward passes for Llama-family models (llama, qwen2, qwen3), tuned for CPU.

It implements the two protocols the loop calls, and nothing outside `grpo_run/backend.py` imports it:
    NativeForward (forward.py)  models.forward.TrainingForward: the update's and old/reference log-probs
    NativeEngine  (engine.py)   rollout.engines.GenerationEngine: our group sampler on the native decoder
Its pieces, each tested against transformers / autograd in tests/native/:
    layers.py         the transformer written out over the model's own modules (no weight copies)
    decoder.py        the decoder over a preallocated KV cache
    shared_prompt.py  rows sharing a prompt share its forward
    fused_head.py     the LM head inside the chunked log-softmax: no [N, T, V] logits
    weight_casts.py   bf16 casts of the weights made once per optimizer step
    lean_ops.py       attention core and SwiGLU with hand-written, memory-lean backwards
    rms_norm.py       RMSNorm as one op with a closed-form backward
    sampling_copy.py  the bf16 copy of the policy that generation samples from
    heap.py           glibc malloc / oneDNN settings and heap trims between phases
`backend=plain` runs transformers' forward everywhere instead; a run with it works without this package.
It depends on transformers' Llama-family module layout (`model.model.layers`, `self_attn.q_proj`, ...)
and on a few private aten ops; `native_unsupported_reason` (layers.py) names what it cannot run.
What each piece saves, measured, with its machine and settings: docs/fast-path.md.
"""
