"""The prompt text grpo-run builds for a TRL-style record equals TRL's own (`trl.data_utils`), and the
conversational detection agrees with TRL's `is_conversational`; where the text differs on purpose, the
test says which difference and checks it (docs/rewards-and-data.md, "What differs from TRL")."""

import json

import pytest

from grpo_run.data.columns import is_conversation
from grpo_run.data.prompts import chat_prompts
from grpo_run.data.splits import load_data
from grpo_run.models.tiny import build_tokenizer
from tests.builders import compose_config

trl_data = pytest.importorskip("trl.data_utils")

SYSTEM = {"role": "system", "content": "You are terse."}
ASK = {"role": "user", "content": "What is 2 + 2?"}
RECORDS = {
    "plain": {"prompt": "What is 2 + 2?", "solution": "4"},
    "with a system turn": {"prompt": [SYSTEM, ASK], "solution": "4"},
    "user turn only": {"prompt": [ASK], "solution": "4"},
    "multi-turn": {
        "prompt": [
            SYSTEM,
            ASK,
            {"role": "assistant", "content": "4"},
            {"role": "user", "content": "And 3 + 3?"},
        ],
        "solution": "6",
    },
    "trailing assistant turn": {
        "prompt": [ASK, {"role": "assistant", "content": "The answer is"}],
        "solution": "4",
    },
}


@pytest.fixture(autouse=True)
def datasets_cache(tmp_path, monkeypatch):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-datasets-cache"))
    monkeypatch.delenv("GRPO_RUN_DATA", raising=False)


def our_prompts(tmp_path, *overrides: str) -> dict[str, str]:
    """Each record through `data=hub` with no keys (a data file), to the text the model is given."""
    path = tmp_path / "trl.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in RECORDS.values()))
    d = compose_config(["data=hub", "eval.every_steps=0", f"data.dataset={path}", *overrides]).data
    examples = load_data(d, evaluate=False)[0]
    for name, example in zip(RECORDS, examples, strict=True):
        # Detected as TRL detects it; the record's columns reach the rewards untouched.
        assert (example.messages is not None) == trl_data.is_conversational(RECORDS[name]), name
        assert example.columns == RECORDS[name]
    return dict(zip(RECORDS, chat_prompts(build_tokenizer(), d, examples), strict=True))


@pytest.mark.parametrize("name", list(RECORDS))
def test_the_detection_agrees_with_trls(name):
    assert is_conversation(RECORDS[name]["prompt"]) == trl_data.is_conversational(RECORDS[name])


def test_conversational_prompts_are_trls_text(tmp_path):
    tok = build_tokenizer()
    ours = our_prompts(tmp_path)
    for name in ("with a system turn", "user turn only", "multi-turn"):
        assert ours[name] == trl_data.maybe_apply_chat_template(RECORDS[name], tok)["prompt"], name
    # A record's own system turn wins over data.system_prompt: still TRL's text.
    ours = our_prompts(tmp_path, "data.system_prompt='Think first.'")
    assert (
        ours["with a system turn"]
        == trl_data.maybe_apply_chat_template(RECORDS["with a system turn"], tok)["prompt"]
    )


def test_where_the_text_differs_on_purpose(tmp_path):
    tok = build_tokenizer()
    ours = our_prompts(tmp_path)

    # 1. A plain-text prompt: TRL gives the model the text as it is; grpo-run puts it in a user turn of the
    # chat template (the models it trains are chat models; data.prompt_template applies there), which is
    # TRL's text for the same prompt given as a conversation.
    plain = RECORDS["plain"]
    assert trl_data.maybe_apply_chat_template(plain, tok)["prompt"] == plain["prompt"]
    as_chat = {"prompt": [{"role": "user", "content": plain["prompt"]}]}
    assert ours["plain"] == trl_data.apply_chat_template(as_chat, tok)["prompt"]

    # 2. A trailing assistant turn: TRL continues it (the completion goes on inside that turn); grpo-run
    # reads it as the answer of a whole conversation and leaves it out, so the completion is a new turn.
    trailing = RECORDS["trailing assistant turn"]
    continued = trl_data.maybe_apply_chat_template(trailing, tok)["prompt"]
    assert continued.endswith("The answer is") and ours["trailing assistant turn"] != continued
    assert (
        ours["trailing assistant turn"]
        == trl_data.apply_chat_template({"prompt": trailing["prompt"][:-1]}, tok)["prompt"]
    )

    # 3. data.system_prompt (no TRL counterpart) comes first in a conversation without a system turn.
    ours = our_prompts(tmp_path, "data.system_prompt='Think first.'")
    with_system = {"prompt": [{"role": "system", "content": "Think first."}, ASK]}
    assert ours["user turn only"] == trl_data.apply_chat_template(with_system, tok)["prompt"]
