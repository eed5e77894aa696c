"""A GRPO run's memory on one device, term by term: pure arithmetic on plain numbers (docs/plan.md).

Every term is bytes on one rank. Two phases have a peak: generation (the sampler's KV cache beside
the resident training state) and the update (gradients, one micro-batch's activations and the log-prob
buffers beside the same state); the optimizer step holds the gradients and a copy of the trainable
weights (train/update_norm) beside it, once the activations are gone. The activation terms follow the
path the run takes: the native forward (`models/native.py` with `lean_ops`: a layer keeps its inputs,
q/k/v, the attention output and the MLP's gate and up for the backward, and recomputes the attention
scores), or transformers' forward (eager attention keeps its float32 probabilities, the MLP keeps
silu(gate) and the down projection's input too).
"""

from dataclasses import dataclass, field, replace
from math import ceil

GB = 2**30  # GiB, as torch and nvidia-smi count device memory
FLOAT32 = 4
# LoRA targets by projection name: (input features, output features) from the model's dimensions.
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class ModelDims:
    """The shapes that size a decoder-only transformer (read from config.json, no weights)."""

    params: int  # every parameter, a tied embedding counted once
    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    max_positions: int

    def projection(self, name: str) -> tuple[int, int]:
        h, q, kv, m = (
            self.hidden,
            self.heads * self.head_dim,
            self.kv_heads * self.head_dim,
            self.intermediate,
        )
        return {
            "q_proj": (h, q),
            "k_proj": (h, kv),
            "v_proj": (h, kv),
            "o_proj": (q, h),
            "gate_proj": (h, m),
            "up_proj": (h, m),
            "down_proj": (m, h),
        }[name]


@dataclass(frozen=True)
class MemoryInputs:
    """Everything the estimate depends on, as plain numbers (`plan.inputs.memory_inputs` reads a Config)."""

    dims: ModelDims
    weight_bytes: int  # bytes per weight: 4 float32, 2 bfloat16/float16
    activation_bytes: int  # bytes per activation: 2 under bf16 autocast, else weight_bytes
    rows: int  # completions per rank per step: B·G / world
    group_size: int  # G
    micro_batch: int  # completions per forward/backward
    prompt_len: int  # the longest prompt, tokens (every row is padded to it)
    completion_len: int  # generation.max_new_tokens
    world: int = 1
    zero_stage: int = 0  # 0: one process (no DeepSpeed); 1 or 2: DeepSpeed ZeRO
    offload_optimizer: bool = False  # ZeRO-Offload: optimizer state in host RAM
    reference: bool = False  # beta > 0: a frozen reference model (none under LoRA: the adapter is disabled)
    old_policy_pass: bool = False  # mu > 1: pi_old log-probs are computed and kept
    # distill=teacher on this device: the frozen teacher's weights (0: none, distill=self, or a device of
    # its own); distillation keeps the teacher's (and the student's) log-probs of the step too.
    teacher_bytes: int = 0
    distill: bool = False
    # distill.form=distribution: the teacher's LM-head input of every completion position is kept for the
    # update (its hidden size taken as the policy's), with a copy of its head on this device where the
    # head is a snapshot (distill=self) or lives elsewhere (distill.teacher.device); the update walks the
    # vocabulary in blocks of about chunk_rows x V floats.
    distill_distribution: bool = False
    teacher_head_copy: bool = False
    gradient_checkpointing: bool = False
    native_forward: bool = True  # the fast path (native forward, lean ops); False: transformers' forward
    fused_head: bool = True  # the LM head inside the chunked log-softmax (native forward only)
    shared_prompt: bool = True  # a prompt's G rows share its forward (native forward only)
    chunk_rows: int = 256  # backend.logprob_chunk_size
    weight_casts: bool = False  # float32 weights under bf16 autocast, cast once per optimizer step
    sampling_copy: bool = False  # float32 weights under bf16 autocast: generation runs a bf16 copy
    lora_rank: int = 0  # 0: full fine-tuning
    lora_targets: tuple[str, ...] = field(default_factory=tuple)
    # generation.engine=vllm colocated: what the engine reserves on this device (gpu_memory_utilization x device
    # memory on a GPU; its CPU KV cache plus its own copy of the weights on CPU). 0: our own decoder.
    vllm_reserved_bytes: int = 0
    # Held-out evaluation (eval.every_steps > 0): eval.batch_size x eval.samples_per_prompt rows decoded
    # at once, eval.max_new_tokens each. 0: no evaluation phase.
    eval_rows: int = 0
    eval_completion_len: int = 0
    # What the process holds beyond the terms, measured on the tiny model (docs/plan.md): CPU only.
    runtime_bytes: int = 0
    # Reward models and judges (reward.functions[i].model) whose workers load them on this device: weights.
    reward_model_bytes: int = 0


def lora_params(dims: ModelDims, rank: int, targets: tuple[str, ...]) -> int:
    """A (r x in) and B (out x r) per targeted projection per layer."""
    if rank <= 0:
        return 0
    per_layer = sum(rank * sum(dims.projection(t)) for t in targets if t in PROJECTIONS)
    return per_layer * dims.layers


def trainable_params(x: MemoryInputs) -> int:
    return lora_params(x.dims, x.lora_rank, x.lora_targets) if x.lora_rank else x.dims.params


def optimizer_bytes_per_param(x: MemoryInputs) -> int:
    """AdamW's two moments: in the parameters' dtype for torch's AdamW (one process); DeepSpeed keeps
    float32 moments, plus a float32 master copy when the weights are half precision."""
    if x.zero_stage == 0:
        return 2 * x.weight_bytes
    return 2 * FLOAT32 + (FLOAT32 if x.weight_bytes < FLOAT32 else 0)


def weights(x: MemoryInputs) -> int:
    return x.dims.params * x.weight_bytes


def lora_weights(x: MemoryInputs) -> int:
    return lora_params(x.dims, x.lora_rank, x.lora_targets) * x.weight_bytes


def gradients(x: MemoryInputs) -> int:
    """Full gradients, or under ZeRO-2 this rank's partition (the reduce buckets are left out)."""
    total = trainable_params(x) * x.weight_bytes
    return ceil(total / x.world) if x.zero_stage >= 2 else total


def optimizer_state(x: MemoryInputs) -> int:
    """On the device: sharded over ranks under ZeRO-1/2, none under offload (`host_optimizer_state`)."""
    if x.offload_optimizer:
        return 0
    total = trainable_params(x) * optimizer_bytes_per_param(x)
    return ceil(total / x.world) if x.zero_stage >= 1 else total


def host_optimizer_state(x: MemoryInputs) -> int:
    """ZeRO-Offload: this rank's optimizer partition in host RAM (not on the device)."""
    if not x.offload_optimizer:
        return 0
    return ceil(trainable_params(x) * optimizer_bytes_per_param(x) / x.world)


def update_snapshot(x: MemoryInputs) -> int:
    """This rank's copy of its share (1/world) of the trainable weights, held across the optimizer step to
    measure train/update_norm (grpo_run/safety/update_norm.py)."""
    return ceil(trainable_params(x) * x.weight_bytes / x.world)


def reference_model(x: MemoryInputs) -> int:
    return weights(x) if x.reference and not x.lora_rank else 0


# Float32 [rows, block] tensors alive at once in a block of the divergence's passes: both models' logits,
# their log-probs, and the pointwise terms (algo/distill.py `_GeneralizedJSD`).
DIVERGENCE_BLOCK_TENSORS = 6


def teacher_states(x: MemoryInputs) -> int:
    """distill.form=distribution: the teacher's head input [rows, T, H] kept for the update, and the
    copy of its head [V, H] where one is made."""
    if not x.distill_distribution:
        return 0
    d = x.dims
    head = d.vocab * d.hidden * x.weight_bytes if x.teacher_head_copy else 0
    return x.rows * x.completion_len * d.hidden * x.activation_bytes + head


def divergence_blocks(x: MemoryInputs) -> int:
    """distill.form=distribution: one vocabulary block of the divergence, about chunk_rows x V floats per
    tensor (the whole micro-batch's loss positions over a slice of the vocabulary)."""
    if not x.distill_distribution:
        return 0
    return DIVERGENCE_BLOCK_TENSORS * x.chunk_rows * x.dims.vocab * FLOAT32


def teacher_model(x: MemoryInputs) -> int:
    """distill=teacher: its weights on every rank, as the reference's are (counted by plan.inputs)."""
    return x.teacher_bytes


def bf16_copy(x: MemoryInputs) -> int:
    """A bfloat16 copy of every weight (sampling copy, or the update's cast-once weights)."""
    return x.dims.params * 2


def prompt_positions(x: MemoryInputs, n: int) -> int:
    """Token positions one layer processes for n completions: a prompt shared by its group's rows goes
    through once (shared-prompt forward), else every row carries its own copy."""
    if x.native_forward and x.shared_prompt:
        prompts = ceil(n / x.group_size) if n >= x.group_size else 1
        return prompts * x.prompt_len + n * x.completion_len
    return n * (x.prompt_len + x.completion_len)


def saved_per_position(x: MemoryInputs) -> int:
    """Bytes one decoder layer keeps for the backward per token position.

    The residual stream (into both norms) is in the weights' dtype; the rest in the activation dtype:
    the two normalised inputs (h each), q and the attention output (heads·d each), k and v (kv_heads·d
    each), gate and up (m each). transformers' forward keeps silu(gate) and the down projection's input too.
    """
    d = x.dims
    q, kv = d.heads * d.head_dim, d.kv_heads * d.head_dim
    kept = 2 * d.hidden + 2 * q + 2 * kv + 2 * d.intermediate
    if not x.native_forward:
        kept += 2 * d.intermediate
    return 2 * d.hidden * x.weight_bytes + kept * x.activation_bytes


def attention_scores(x: MemoryInputs, n: int) -> int:
    """One layer's score matrices alive at once: the scores, their float32 softmax and the rounded
    probabilities (the native forward recomputes them in the backward, one layer at a time)."""
    d = x.dims
    p, t = x.prompt_len, x.completion_len
    if x.native_forward and x.shared_prompt:
        prompts = ceil(n / x.group_size) if n >= x.group_size else 1
        entries = d.heads * (prompts * p * p + n * t * (p + t))
    else:
        entries = d.heads * n * (p + t) ** 2
    return entries * (2 * x.activation_bytes + FLOAT32)


def activations(x: MemoryInputs) -> int:
    """One micro-batch's activations at the backward's peak.

    Checkpointed: every layer's input (residual stream) plus one layer's recomputation. Otherwise every
    layer's saved tensors. transformers' eager attention also keeps each layer's probabilities.
    """
    n = min(x.micro_batch, x.rows)
    pos = prompt_positions(x, n)
    one_layer = pos * saved_per_position(x) + attention_scores(x, n)
    if not x.native_forward:
        kept_scores = attention_scores(x, n)  # eager attention saves them for the backward
        one_layer += kept_scores
    if x.gradient_checkpointing:
        return x.dims.layers * pos * x.dims.hidden * x.weight_bytes + one_layer
    return x.dims.layers * one_layer


def logprob_buffers(x: MemoryInputs) -> int:
    """The LM head and log-softmax of one micro-batch's completion tokens.

    Fused (native forward): `chunk_rows` rows of float32 logits, their exponentials and their gradient at
    a time, never [n, T, V]. Otherwise the logits and their gradient in the activation dtype, plus the
    float32 chunk buffers.
    """
    n = min(x.micro_batch, x.rows)
    tokens = n * x.completion_len
    chunk = min(x.chunk_rows, tokens) * x.dims.vocab * FLOAT32
    hidden = 2 * tokens * x.dims.hidden * FLOAT32  # the head's input and its gradient
    if x.native_forward and x.fused_head:
        return 3 * chunk + hidden
    return 2 * tokens * x.dims.vocab * x.activation_bytes + 2 * chunk + hidden


def kv_cache(x: MemoryInputs) -> int:
    """Our decoder's KV cache for every row of the step at full length, plus the sampled position's
    float32 logits and probabilities. None with vLLM (its reservation covers it)."""
    if x.vllm_reserved_bytes:
        return 0
    d = x.dims
    dtype = 2 if (x.sampling_copy or x.activation_bytes == 2) else x.weight_bytes
    cache = x.rows * (x.prompt_len + x.completion_len) * d.layers * 2 * d.kv_heads * d.head_dim * dtype
    return cache + 2 * x.rows * d.vocab * FLOAT32


def eval_kv_cache(x: MemoryInputs) -> int:
    """The held-out evaluation's sampled pass: its rows at its length, through the same decoder."""
    if not x.eval_rows:
        return 0
    return kv_cache(replace(x, rows=x.eval_rows, completion_len=x.eval_completion_len))


def rollout_tensors(x: MemoryInputs) -> int:
    """The step's ids and masks (int64) and its per-token log-probs, advantages and loss mask (float32)."""
    length = x.prompt_len + x.completion_len
    kept = 1 + int(x.reference) + int(x.old_policy_pass) + 2 * int(x.distill)  # + teacher's, student's
    return x.rows * (3 * length * 8 + (kept + 2) * x.completion_len * FLOAT32)


@dataclass(frozen=True)
class MemoryEstimate:
    components: dict[str, int]  # term -> bytes
    phases: dict[str, int]  # phase -> bytes at its peak
    phase_terms: dict[str, list[str]]  # phase -> the terms it adds up
    host_bytes: int  # what lives in host RAM instead (ZeRO-Offload's optimizer state)

    @property
    def peak(self) -> int:
        return max(self.phases.values())

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.phases.__getitem__)


def estimate(x: MemoryInputs) -> MemoryEstimate:
    """Every term, and the sum of the terms each phase holds at its peak."""
    components = {
        "weights": weights(x),
        "lora_adapter": lora_weights(x),
        "gradients": gradients(x),
        "optimizer_state": optimizer_state(x),
        "reference_model": reference_model(x),
        "teacher_model": teacher_model(x),
        "teacher_states": teacher_states(x),
        "divergence_blocks": divergence_blocks(x),
        "sampling_copy": bf16_copy(x) if x.sampling_copy and not x.vllm_reserved_bytes else 0,
        "weight_casts": bf16_copy(x) if x.weight_casts else 0,
        "update_snapshot": update_snapshot(x),
        "activations": activations(x),
        "logprob_buffers": logprob_buffers(x),
        "kv_cache": kv_cache(x),
        "vllm_reservation": x.vllm_reserved_bytes,
        "rollout_tensors": rollout_tensors(x),
        "eval_kv_cache": eval_kv_cache(x),
        "runtime": x.runtime_bytes,
        "reward_models": x.reward_model_bytes,
    }
    resident = [
        "weights",
        "lora_adapter",
        "optimizer_state",
        "reference_model",
        "teacher_model",
        "vllm_reservation",
        "runtime",
        "reward_models",
    ]
    phase_terms = {
        # Gradients are freed after each optimizer step (zero_grad(set_to_none=True)).
        "generation": [*resident, "sampling_copy", "kv_cache", "rollout_tensors"],
        "update": [
            *resident,
            "gradients",
            "weight_casts",
            "activations",
            "logprob_buffers",
            "rollout_tensors",
            "teacher_states",
            "divergence_blocks",
        ],
        # The backward pass is done (its activations freed); the gradients are freed after the step.
        "optimizer_step": [*resident, "gradients", "update_snapshot", "rollout_tensors"],
    }
    if x.eval_rows:
        phase_terms["evaluation"] = [*resident, "sampling_copy", "eval_kv_cache"]
    phases = {name: sum(components[t] for t in terms) for name, terms in phase_terms.items()}
    return MemoryEstimate(components, phases, phase_terms, host_optimizer_state(x))


def with_changes(x: MemoryInputs, **changes) -> MemoryInputs:
    return replace(x, **changes)
