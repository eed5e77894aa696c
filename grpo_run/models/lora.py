"""LoRA through PEFT (`lora=default`): adapters on the policy's linear projections, only they train.

The policy the rest of the run sees stays the transformers model: PEFT replaces its projections in place
by `lora.Linear` modules (the frozen base layer plus the adapter), so every forward that calls the
projection modules computes with the current adapter. That covers transformers' forward, the native
training forward and the native decoder (`native/layers.py` calls a projection that is not a plain
`nn.Linear` as a module, and packs no projections). The bf16 sampling copy is a plain model with the
adapters merged into its weights (`MergedSamplingWeights`), rebuilt from the current adapter after every
step; a vLLM engine receives the same merged weights at every sync (`merged_named_parameters`).
`tests/models/test_lora.py` checks each path against transformers' forward of the PeftModel.

The LM head and the embeddings are never adapted: the native forward reads their weights directly
(fused head, tied lookup), so a target naming them is refused (`resolve_targets`).

With grpo.beta > 0 the reference model is the policy inside `disable_adapter()`: the base weights, which
never change, and no second copy of them in memory.
"""

from __future__ import annotations

import contextlib
import copy
import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerBase

from grpo_run.config.schema import LoraConfig, ModelConfig, ModelKind
from grpo_run.config.validation import ConfigError

if TYPE_CHECKING:  # peft is imported where an adapter is made or read: a run without LoRA never loads it
    from peft import PeftModel

ALL_LINEAR = "all-linear"
ADAPTER_CONFIG = "adapter_config.json"  # PEFT's name: a folder holding it is an adapter folder
MERGED = "merged"  # final/merged: the adapter merged into the base weights (lora.save_merged)


def adaptable_linear_names(model: torch.nn.Module) -> list[str]:
    """Full names of the linear modules LoRA may adapt: every `nn.Linear` but the LM head (PEFT's
    `all-linear` rule, which TRL and verl recipes use)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return [
        name
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and module is not head
    ]


def resolve_targets(linear_names: list[str], wanted: list[str]) -> list[str]:
    """`lora.target_modules` -> the full names of the modules to adapt. `all-linear`: every one; otherwise
    each entry is a module name or a dotted suffix of one (`q_proj`, `self_attn.o_proj`), and an entry
    that matches no adaptable linear module is a config error naming the key and listing the choices."""
    if ALL_LINEAR in wanted:
        return list(linear_names)
    chosen: set[str] = set()
    for entry in wanted:
        hits = [n for n in linear_names if n == entry or n.endswith("." + entry)]
        if not hits:
            short = sorted({n.rsplit(".", 1)[-1] for n in linear_names})
            raise ConfigError(
                f"lora.target_modules={wanted!r}: {entry!r} names no linear module of the model (the LM head "
                f"and embeddings are never adapted); its linear modules: {short} (or {ALL_LINEAR!r})"
            )
        chosen.update(hits)
    return [n for n in linear_names if n in chosen]


def check_targets(model_path: str, lora: LoraConfig) -> list[str]:
    """The modules to adapt, from the model's structure built on the meta device (no weights loaded),
    so a bad `lora.target_modules` exits 2 before the model loads."""
    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    return resolve_targets(adaptable_linear_names(skeleton), list(lora.target_modules))


class LoraPolicy:
    """The PEFT wrapper around the policy: the adapter switch, counts, and saving."""

    def __init__(self, peft_model: PeftModel) -> None:
        self.peft_model = peft_model

    @property
    def model(self) -> PreTrainedModel:
        """The transformers model with the adapters inside its projections: what the run trains and samples."""
        return self.peft_model.get_base_model()

    def trainable_parameters(self) -> tuple[int, int]:
        """(trainable, all) parameter counts."""
        return self.peft_model.get_nb_trainable_parameters()

    @contextlib.contextmanager
    def adapter_disabled(self) -> Iterator[PreTrainedModel]:
        """The base model, for the reference log-probs: every adapter bypassed inside the block."""
        with self.peft_model.disable_adapter():
            yield self.model

    def save(self, folder: Path, tokenizer: PreTrainedTokenizerBase, *, merged: bool) -> None:
        """`folder`: PEFT's adapter folder (adapter_config.json, adapter_model.safetensors) and the tokenizer;
        with `merged`, also `folder/merged`, a transformers folder of the base weights plus the adapter.
        Merging rewrites the policy's projections in place: call it last."""
        self.peft_model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        if merged:
            plain = self.peft_model.merge_and_unload()
            plain.save_pretrained(folder / MERGED)
            tokenizer.save_pretrained(folder / MERGED)


def wrap(policy: PreTrainedModel, lora: LoraConfig, targets: list[str], *, seed: int = 0) -> LoraPolicy:
    """Put LoRA adapters on `targets` (full module names, from `check_targets`); freezes everything else.

    The adapters' A matrices start random (B at zero): drawn from their own generator state seeded by
    `seed`, so they do not depend on what drew from the global generators before (building the tiny
    model's cache in this process does) and every rank starts from the same adapter."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    peft_config = PeftLoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=targets,
        bias="none",
        task_type="CAUSAL_LM",
    )
    device = next(policy.parameters()).device
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        return LoraPolicy(get_peft_model(policy, peft_config))


def describe(policy: LoraPolicy) -> str:
    trainable, total = policy.trainable_parameters()
    return f"LoRA: {trainable:,} trainable parameters of {total:,} ({100 * trainable / total:.2f}%)"


@torch.no_grad()
def merged_named_parameters(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every parameter of a model with LoRA modules inside, under its plain transformers name, with the
    adapters merged: an adapted projection's weight is W + (alpha/r)·B·A (PEFT's `get_delta_weight`)
    and its bias the base layer's; the adapter tensors themselves are not listed. Computed beside the
    policy, which is not modified (PEFT's merge would rewrite it in place). Tied parameters appear under
    each of their names. This is what a plain copy of the policy (the bf16 sampling copy, a vLLM engine)
    needs to compute what the adapted policy computes."""
    from peft.tuners.lora import LoraLayer

    adapted = {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}
    out = []
    for name, param in model.named_parameters(remove_duplicate=False):
        owner, leaf = name.rsplit(".", 1)
        layer = adapted.get(owner.removesuffix(".base_layer"))
        if layer is None:
            if ".lora_" in name:
                continue  # an adapter tensor (`q_proj.lora_A.default.weight`): merged into its weight
        elif owner.endswith(".base_layer"):  # `q_proj.base_layer.weight` -> `q_proj.weight`
            owner = owner.removesuffix(".base_layer")
            if leaf == "weight":
                (adapter,) = layer.active_adapters
                param = param + layer.get_delta_weight(adapter)
        out.append((f"{owner}.{leaf}", param.detach()))
    return out


class MergedSamplingWeights:
    """The bf16 sampling copy of a LoRA policy with the adapters merged into its projections (the
    interface of `native.sampling_copy.SamplingWeights`, which `native.generation.NativeEngine` uses).

    Sampling from the policy itself would run every adapted projection as PEFT's module (base matmul,
    two adapter matmuls, and no packed q/k/v or gate/up in the native decoder). The copy is a plain
    model instead: each adapted weight is bf16(W + (alpha/r)·B·A), PEFT's own delta
    (`get_delta_weight`), recomputed from the current adapter when stale (`mark_stale` after every
    optimizer step, `release` after every generation); every other weight is the policy's rounded to
    bf16, as in `SamplingWeights`. The samples come from the same weights, merged before the rounding
    to bf16 instead of after (docs/lora.md)."""

    def __init__(self, policy: LoraPolicy) -> None:
        self.policy = policy.model
        with torch.no_grad():
            plain = copy.deepcopy(policy.peft_model).merge_and_unload()
        self.copy = plain.to(torch.bfloat16).eval().requires_grad_(False)
        self.release()  # empty until first used: weights restored from a checkpoint come after this

    @property
    def is_copy(self) -> bool:
        return True

    def mark_stale(self) -> None:
        self._stale = True

    @torch.no_grad()
    def model(self) -> torch.nn.Module:
        if self._stale:
            merged = dict(merged_named_parameters(self.policy))
            for name, param in self.copy.named_parameters():  # tied weights are one parameter here too
                param.data = merged[name].to(torch.bfloat16)
            self._stale = False
        return self.copy

    def release(self) -> None:
        """Free the copy's weights; the next `model()` rebuilds them from the current adapter."""
        for param in self.copy.parameters():
            param.data = torch.empty(0, dtype=torch.bfloat16, device=param.device)
        self._stale = True


# ------------------------------------------------------------------------------------ evaluation


def adapter_folder(checkpoint: str | None) -> Path | None:
    """The adapter folder `eval.checkpoint` names: itself, or a LoRA run dir's final/ (None: not LoRA)."""
    if checkpoint is None:
        return None
    folder = Path(checkpoint).expanduser()
    for candidate in (folder, folder / "final"):
        if (candidate / ADAPTER_CONFIG).is_file() and not (candidate / "config.json").is_file():
            return candidate
    return None


def base_model_config(model: ModelConfig, adapter: Path) -> ModelConfig:
    """The adapter's base model (the folder PEFT recorded when the run saved it), as a ModelConfig."""
    base = json.loads((adapter / ADAPTER_CONFIG).read_text())["base_model_name_or_path"]
    return replace(model, kind=ModelKind.PRETRAINED, path=base)


def merged_with_adapter(base: PreTrainedModel, adapter: Path) -> PreTrainedModel:
    """`base` with the saved adapter merged into its weights: evaluation then runs a plain model."""
    from peft import PeftModel

    return PeftModel.from_pretrained(base, str(adapter)).merge_and_unload()
