"""The one door to the implementations behind the loop's two protocols, chosen by the config.

    training forward   models.forward.TrainingForward   TransformersForward | native.NativeForward
    generation engine  rollout.engines.GenerationEngine TransformersEngine  | native.NativeEngine
                                                        | rollout.vllm_engine.VLLMEngine (generation=vllm)

The fast path (`grpo_run/native/`) is imported here only, and only when the `backend` group asks for a
piece of it: with `backend=plain` a run never imports it.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from grpo_run.config.schema import BackendConfig, Config, GenerationEngineKind, KernelChoice, ModelConfig
from grpo_run.data import Example
from grpo_run.data.prompts import chat_prompts
from grpo_run.models.forward import TrainingForward, TransformersForward
from grpo_run.packing.settings import packing_state
from grpo_run.rollout.engines import EngineCapabilities, GenerationEngine, TransformersEngine

if TYPE_CHECKING:  # PEFT is imported only by runs with lora=default
    from grpo_run.models.lora import LoraPolicy


def uses_native(b: BackendConfig) -> bool:
    return b.forward != KernelChoice.HF or b.decoder != KernelChoice.HF


def prepare_process(b: BackendConfig) -> None:
    """Process-wide settings the fast path wants, made before the first tensor is allocated."""
    if b.tune_allocator:
        from grpo_run.native.heap import prepare_process as tune

        tune()


def training_forward(cfg: Config, device: torch.device) -> TrainingForward:
    b = cfg.backend
    common = dict(
        temperature=cfg.generation.temperature,
        chunk_size=b.logprob_chunk_size,
        autocast_bf16=cfg.model.autocast_bf16,
        device=device,
        packing=packing_state(cfg),  # trainer.padding_free (None: padded micro-batches)
    )
    if b.forward == KernelChoice.HF:
        return TransformersForward(**common)
    from grpo_run.native.forward import NativeForward

    return NativeForward(
        **common,
        choice=b.forward.value,
        share_prompts=b.shared_prompt_forward,
        # Not with LoRA: the adapted projections run as PEFT's modules, which the casts never reach, and
        # their input's shared bf16 cast would round the adapter gradients unlike autocast (docs/lora.md).
        cast_weights_once=b.cast_weights_once and not cfg.lora.enabled,
        fused_head=b.fused_lm_head,
        release_free_memory=b.release_free_memory,
        trim_every_layers=b.release_free_memory_layers,
    )


def engine_class(cfg: Config) -> type:
    """The GenerationEngine class `generation_engine` builds for `cfg` (imports only that one's module)."""
    if cfg.generation.engine == GenerationEngineKind.VLLM:
        from grpo_run.rollout.vllm_engine import VLLMEngine

        return VLLMEngine
    if cfg.generation.engine != GenerationEngineKind.LOCAL:
        raise ValueError(f"generation.engine={cfg.generation.engine.value} has no builder")
    b = cfg.backend
    if b.decoder == KernelChoice.HF and not b.bf16_sampling_copy:
        return TransformersEngine
    from grpo_run.native.generation import NativeEngine

    return NativeEngine


def engine_capabilities(cfg: Config) -> EngineCapabilities:
    """What the engine `cfg` asks for can do (`EngineCapabilities`), before it is built."""
    return engine_class(cfg).CAPABILITIES


@dataclass(frozen=True)
class SamplingRole:
    """What an engine's caller knows beyond the config. owns_policy: nothing else uses the policy's weights
    (mode=eval). model_cfg: the folder a vLLM engine starts from (default cfg.model). rank: this process's
    rank (a vLLM engine's seed). lora: the policy's PEFT wrapper: the bf16 copy, or the vLLM engine,
    receives the weights with the adapters merged. report_logprobs: a local engine's rollouts carry its
    decoder's log-probs of the sampled tokens (vLLM's always do)."""

    rank: int = 0
    lora: "LoraPolicy | None" = None
    owns_policy: bool = False
    model_cfg: ModelConfig | None = None
    report_logprobs: bool = False


def sampling_engine(
    cfg: Config,
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    examples: Sequence[Example],
    role: SamplingRole = SamplingRole(),
) -> GenerationEngine:
    """The one builder of the sampling side's engine, for training, evaluation and the generation worker:
    `generation_engine`, sized (an engine with weights of its own sizes its context from every prompt
    it may continue) for the formatted prompts of `examples`."""
    wants_prompts = engine_capabilities(cfg).own_weights
    prompts = chat_prompts(tokenizer, cfg.data, list(examples)) if wants_prompts else []
    return generation_engine(cfg, model, tokenizer, role, prompts=prompts)


def generation_engine(
    cfg: Config,
    policy: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    role: SamplingRole = SamplingRole(),
    prompts: Sequence[str] = (),
) -> GenerationEngine:
    """The engine `generation.engine` names, sampling from `policy` for `role`; `prompts` (vllm only):
    every formatted prompt it may continue (for its default max_model_len)."""
    if cfg.generation.engine == GenerationEngineKind.VLLM:
        from grpo_run.rollout.vllm_engine import build_vllm_engine

        device = next(policy.parameters()).device
        return build_vllm_engine(
            cfg,
            role.model_cfg or cfg.model,
            policy,
            tokenizer,
            list(prompts),
            device,
            role.rank,
            lora=role.lora is not None,
        )
    b = cfg.backend
    ids = dict(
        eos_id=tokenizer.eos_token_id,
        pad_id=tokenizer.pad_token_id,
        autocast_bf16=cfg.model.autocast_bf16,
        report_logprobs=role.report_logprobs,
    )
    if engine_class(cfg) is TransformersEngine:
        return TransformersEngine(policy, **ids)
    from grpo_run.native.generation import NativeEngine

    make_copy = None
    if role.lora is not None:
        from grpo_run.models.lora import MergedSamplingWeights

        lora = role.lora
        make_copy = lambda _: MergedSamplingWeights(lora)  # noqa: E731
    return NativeEngine(
        policy,
        **ids,
        decoder=b.decoder.value,
        bf16_sampling_copy=b.bf16_sampling_copy,
        owns_policy=role.owns_policy,
        make_copy=make_copy,
    )
