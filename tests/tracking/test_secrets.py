"""What `redact` treats as a secret, and what it must leave alone (ordinary config keys and values)."""

import pytest

from grpo_run.tracking.secrets import REDACTED, redact

KEEP = [
    "generation.max_new_tokens=8",
    "max_new_tokens: 32",
    "data.max_prompt_tokens=100",
    "tokenizer: left",
    "eos_token_id=2",
    "trainer.lr=1e-5",
]


@pytest.mark.parametrize("text", KEEP)
def test_ordinary_keys_are_kept(text, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    assert redact(text) == text


SECRETS = [
    ("+logger.api_key=abc123secret", f"+logger.api_key={REDACTED}"),
    ("hf_token: qwertyuiop", f"hf_token: {REDACTED}"),
    ("tags=[" + "a" * 40 + "]", f"tags=[{REDACTED}]"),  # a W&B key's shape
    ("name=hf_" + "x1" * 16, f"name={REDACTED}"),  # a Hugging Face token's shape
]


@pytest.mark.parametrize("text,expected", SECRETS)
def test_named_and_shaped_secrets_are_redacted(text, expected):
    assert redact(text) == expected


def test_values_of_secret_environment_variables_are_redacted_anywhere(monkeypatch):
    monkeypatch.setenv("MY_SERVICE_TOKEN", "s3cr3t-value-xyz")
    assert redact("logger.name=run-s3cr3t-value-xyz-1") == f"logger.name=run-{REDACTED}-1"
