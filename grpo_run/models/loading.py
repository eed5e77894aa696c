"""Load the policy, the frozen reference and the tokenizer from a `ModelConfig`."""

import json
import os
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase
from transformers.utils import logging as hf_logging

from grpo_run.config.schema import DType, ModelConfig, ModelKind
from grpo_run.models.dropout import disable_dropout
from grpo_run.models.model_cache import ModelCacheError
from grpo_run.models.smollm2 import SmolLM2Missing, ensure_smollm2
from grpo_run.models.tiny import ensure_tiny_model
from grpo_run.tracking.sinks import console

TORCH_DTYPES = {DType.FLOAT32: torch.float32, DType.BFLOAT16: torch.bfloat16, DType.FLOAT16: torch.float16}


class ModelLoadError(RuntimeError):
    """A model or tokenizer that cannot be loaded; the message says which and what to do."""


def resolve_model_path(cfg: ModelConfig) -> str:
    if cfg.kind in (ModelKind.TINY, ModelKind.SMOLLM2) and "${" in cfg.cache_dir:
        # A ModelConfig made in Python keeps the schema's default as text; only OmegaConf resolves it.
        # Used as a path, it would create a folder literally named "${oc.env:…".
        raise ModelLoadError(
            f"model.cache_dir is an unresolved interpolation ({cfg.cache_dir!r}): build the config with "
            "grpo_run.config (Hydra or OmegaConf resolve it) or give ModelConfig(cache_dir=...) a folder"
        )
    try:
        if cfg.kind == ModelKind.TINY:
            return str(ensure_tiny_model(cfg.cache_dir))
        if cfg.kind == ModelKind.SMOLLM2:
            return str(ensure_smollm2(cfg.cache_dir))
    except (SmolLM2Missing, ModelCacheError) as err:
        raise ModelLoadError(str(err)) from err
    assert cfg.path is not None  # validated at the door
    return cfg.path


POLICY_PATH = "model.path"


def _folder_hint(key: str | None) -> str:
    """How to give a folder instead, for the key the path came from (None: the caller names the key)."""
    if key == POLICY_PATH:
        return "point to a folder: model=local model.path=/path/to/folder"
    return f"point {key} to a folder" if key else "point to a folder instead"


def _explain(path: str, err: Exception, key: str | None) -> ModelLoadError:
    offline = os.environ.get("HF_HUB_OFFLINE", "0")
    where = "a local folder" if Path(path).exists() else "a hub id"
    return ModelLoadError(
        f"cannot load model '{path}' ({where}; HF_HUB_OFFLINE={offline}): {type(err).__name__}: {err}\n"
        "Without network, a hub id loads only from the local cache (set HF_HOME to the cache that holds it, "
        f"with HF_HUB_OFFLINE=1), or {_folder_hint(key)}"
    )


CODE_FILES = ("config.json", "tokenizer_config.json")
_SAID_IGNORED: set[str] = set()  # folders whose ignored auto_map this process has already named


def _json_object(file: Path) -> dict:
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}  # no such file here (a hub id, or none): transformers reports what is missing
    return data if isinstance(data, dict) else {}


def guard_foreign_code(path: str, trust_remote_code: bool) -> None:
    """A local folder whose config names its own Python (`auto_map`) never has that Python run unless
    `model.trust_remote_code=true`.

    - Its `model_type` is one transformers knows: the built-in classes load (what transformers does with
      `trust_remote_code=False`, which every load below passes) and one line says the folder's code was
      ignored.
    - Its `model_type` is defined only by its own code (unknown to transformers, or absent): refused,
      naming the folder and the key. transformers would otherwise ask "run the custom code? [y/N]" on
      stdin, and a `y` (or a piped one) runs that folder's Python; a run has no human at stdin.
    Hub ids get the same protection from the explicit `trust_remote_code=False`.
    """
    if trust_remote_code:
        return
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    folder = Path(path)
    files = {name: _json_object(folder / name) for name in CODE_FILES}
    named = {name: data["auto_map"] for name, data in files.items() if data.get("auto_map")}
    if not named:
        return
    model_type = files["config.json"].get("model_type")
    where = "; ".join(
        f"{name} auto_map {sorted(map(str, auto_map)) if isinstance(auto_map, dict) else auto_map!r}"
        for name, auto_map in named.items()
    )
    if not (isinstance(model_type, str) and model_type in CONFIG_MAPPING):
        what = f"a model_type transformers does not know ({model_type!r})" if model_type else "no model_type"
        raise ModelLoadError(
            f"model folder {folder.resolve()} names its own code ({where}) and {what}: only that code "
            "defines the model, and grpo-run never runs a model folder's code unless "
            "model.trust_remote_code=true, which executes it with this run's rights"
        )
    key = str(folder.resolve())
    if key not in _SAID_IGNORED:
        _SAID_IGNORED.add(key)
        console.print(
            f"model folder {key}: its own code ({where}) is ignored; transformers' built-in classes "
            f"for model_type {model_type!r} load instead",
            style="yellow",
            soft_wrap=True,
            markup=False,
            highlight=False,
        )


def model_config(cfg: ModelConfig, key: str = POLICY_PATH):
    """The folder's transformers config (no weights), for limits such as the maximum positions. `key`:
    the config key `cfg.path` came from, which a load error tells the user to change."""
    from transformers import AutoConfig

    path = resolve_model_path(cfg)
    guard_foreign_code(path, cfg.trust_remote_code)
    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError) as err:
        raise _explain(path, err, key) from err


def load_tokenizer(cfg: ModelConfig, key: str = POLICY_PATH) -> PreTrainedTokenizerBase:
    return tokenizer_at(resolve_model_path(cfg), cfg.trust_remote_code, key=key)


def tokenizer_at(path: str, trust_remote_code: bool, *, key: str | None = None) -> PreTrainedTokenizerBase:
    """The folder's (or hub id's) tokenizer behind the foreign-code guard, left-padding, with a pad token."""
    guard_foreign_code(path, trust_remote_code)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as err:
        raise _explain(path, err, key) from err
    # Prompts are left-padded so every completion starts at the same column.
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def enable_checkpointing(model: PreTrainedModel) -> None:
    """Every decoder layer recomputes its forward in the backward: transformers' own layers (the hf
    backend) with the non-reentrant torch checkpoint, the native forward with the reentrant one
    (`native_logits`). transformers 5 renamed `gradient_checkpointing_enable` to
    `activation_checkpointing_enable`; either also makes the embedding's output require grad."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def pretrained(
    auto_class: type,
    path: str,
    *,
    dtype: DType,
    trust_remote_code: bool,
    attn_implementation: str | None = None,
    key: str | None = None,
    **options: object,
) -> PreTrainedModel:
    """`auto_class.from_pretrained(path, **options)` (a causal LM, a sequence classifier) behind the
    foreign-code guard, in `dtype`; a ModelLoadError that says what to do otherwise (`key`: the config key
    `path` came from; None where the caller names it)."""
    hf_logging.disable_progress_bar()
    guard_foreign_code(path, trust_remote_code)
    kwargs = {**options, "dtype": TORCH_DTYPES[dtype], "trust_remote_code": trust_remote_code}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    try:
        return auto_class.from_pretrained(path, **kwargs)
    except (OSError, ValueError) as err:
        raise _explain(path, err, key) from err


def load_model(
    cfg: ModelConfig, device: torch.device, *, trainable: bool, key: str = POLICY_PATH
) -> PreTrainedModel:
    """The causal LM of `cfg` on `device`; `key`: the config key its path came from (a teacher's is
    distill.teacher.path), which a load error names."""
    path = resolve_model_path(cfg)
    model = pretrained(
        AutoModelForCausalLM,
        path,
        dtype=cfg.dtype,
        trust_remote_code=cfg.trust_remote_code,
        attn_implementation=cfg.attn_implementation,
        key=key,
    )
    model.to(device)
    if trainable:
        model.train()
        if cfg.gradient_checkpointing:
            enable_checkpointing(model)
            model.config.use_cache = False
    else:  # a reference or a teacher: eval mode already; its dropout zeroed too, as TRL does
        model.eval()
        model.requires_grad_(False)
        if cfg.disable_dropout:
            disable_dropout(model)
    return model
