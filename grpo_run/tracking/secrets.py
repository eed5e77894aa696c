"""Secrets never reach disk: key-like values are redacted in everything the run writes.

What counts as a secret: the value of an environment variable whose name ends in KEY, TOKEN, SECRET,
PASSWORD or CREDENTIALS (WANDB_API_KEY, HF_TOKEN, ...); a value given to a key whose name ends so
(`+logger.api_key=...`, not `max_new_tokens`); text shaped like a W&B API key (40 hex digits, or
`wandb_v1_...`) or a Hugging Face token (`hf_...`). `redact` replaces each with `<redacted>`.

Where it applies (docs/reliability.md): this process's `sys.argv` (which W&B copies into its run
metadata and the offline `.wandb` file), every line it writes to stdout and stderr (Hydra's own error
messages and tracebacks included), Hydra's `.hydra/*.yaml`, `config_resolved.yaml`, every log record,
and the W&B run's config.
"""

import logging
import os
import re
import sys
from pathlib import Path

REDACTED = "<redacted>"
# A name that ends in one of these words names a secret (WANDB_API_KEY, HF_TOKEN, AWS_SECRET_ACCESS_KEY,
# logger.api_key); "max_new_tokens" or "tokenizer" do not end in one.
SECRET_WORDS = r"(?:api_?key|token|secret|password|passwd|credentials?)"
# Environment names: also any *KEY (AWS_SECRET_ACCESS_KEY, OPENAI_API_KEY, ...).
SECRET_NAME = re.compile(rf"(?:{SECRET_WORDS}|key)$", re.IGNORECASE)
SHAPES = re.compile(r"\b(?:[0-9a-f]{40}|wandb_v1_[A-Za-z0-9_]{20,}|hf_[A-Za-z0-9]{30,})\b")
# key=value (an override) or key: value (YAML) whose key ends in a secret's word.
NAMED = re.compile(
    rf"(?P<key>\b[\w.+~-]*{SECRET_WORDS})(?P<sep>['\"]?\s*[=:]\s*)(?P<value>[^\s,\]\}}'\"]+)",
    re.IGNORECASE,
)
MIN_SECRET_LEN = 8  # shorter values (a flag like "1") would redact ordinary text


def environment_secrets() -> list[str]:
    values = [v for k, v in os.environ.items() if SECRET_NAME.search(k) and len(v) >= MIN_SECRET_LEN]
    return sorted(set(values), key=len, reverse=True)  # the longest first: no partial replacements


def redact(text: str) -> str:
    for value in environment_secrets():
        text = text.replace(value, REDACTED)
    text = SHAPES.sub(REDACTED, text)
    return NAMED.sub(lambda m: f"{m['key']}{m['sep']}{REDACTED}", text)


def redact_file(path: Path) -> None:
    """Rewrite a text file the run (or Hydra) wrote, when it holds a secret."""
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError):
        return
    clean = redact(text)
    if clean != text:
        path.write_text(clean)


class RedactingStream:
    """A text stream that redacts each line before it reaches the real one. A line is held until its
    newline (so a secret split over two writes is still whole) or until a flush (progress bars)."""

    def __init__(self, stream) -> None:
        self._stream = stream
        self._pending = ""

    def write(self, text: str) -> int:
        self._pending += text
        head, newline, self._pending = self._pending.rpartition("\n")
        if newline:
            self._stream.write(redact(head + newline))
        return len(text)

    def writelines(self, lines) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        if self._pending:
            self._stream.write(redact(self._pending))
            self._pending = ""
        self._stream.flush()

    def __getattr__(self, name: str):  # fileno, isatty, encoding, ...: the real stream's
        return getattr(self._stream, name)


def redact_streams() -> None:
    """From here on every line this process prints, Hydra's and tracebacks too, is redacted."""
    if not isinstance(sys.stdout, RedactingStream) and sys.stdout is not None:
        sys.stdout = RedactingStream(sys.stdout)
    if not isinstance(sys.stderr, RedactingStream) and sys.stderr is not None:
        sys.stderr = RedactingStream(sys.stderr)


class RedactingFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        clean = redact(message)
        if clean != message:
            record.msg, record.args = clean, None
        return True


def redact_run(run_dir: Path, hydra_subdir: str | None) -> None:
    """Scrub what exists before training starts: the command line, Hydra's records, the log handlers."""
    sys.argv[:] = [redact(arg) for arg in sys.argv]
    if hydra_subdir:
        for path in (run_dir / hydra_subdir).glob("*.yaml"):
            redact_file(path)
    log_filter = RedactingFilter()
    for handler in logging.getLogger().handlers:
        handler.addFilter(log_filter)
