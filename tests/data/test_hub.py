"""data=hub through the real `datasets` library, offline: data files, save_to_disk folders, conversational
columns, the columns rule, carving, the presets' local overrides and the one-line offline error."""

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from grpo_run.config import ConfigError
from grpo_run.config.schema import DataConfig
from grpo_run.config.validation import validate
from grpo_run.data import DataError, DataKeyError, Example, load_jsonl
from grpo_run.data import splits as data_splits
from grpo_run.data.prompts import chat_messages, chat_prompts, prompt_bytes
from grpo_run.data.splits import evaluation_on, has_eval_split, load_data, load_eval_split
from tests.builders import compose_config
from tests.helpers import GRPO_RUN

REPO = Path(__file__).resolve().parents[2]
SHARED_DATA = REPO / ".." / "shared" / "data"
ROWS = [
    {
        "problem": f"What is {i} + {i}?",
        "solution": f"{i} + {i} = {2 * i}",
        "answer": 2 * i,
        "tags": ["add", f"n{i}"],
    }
    for i in range(10)
]


@pytest.fixture(autouse=True)
def datasets_cache(tmp_path, monkeypatch):
    """`datasets` writes its Arrow cache to a private folder, never the user's ~/.cache."""
    import datasets

    cache = tmp_path / "hf-datasets-cache"
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(cache))
    monkeypatch.delenv("GRPO_RUN_DATA", raising=False)
    return cache


def hub_config(*overrides: str) -> DataConfig:
    return compose_config(["data=hub", "eval.every_steps=0", *overrides]).data


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_data_file_is_one_train_split_carved_by_seed(tmp_path, monkeypatch):
    path = write_jsonl(tmp_path / "sums.jsonl", ROWS)
    fields = ["data.question_field=problem", f"data.dataset={path}", "data.eval_size=3"]
    d = hub_config(*fields, "data.train_split=null", "data.eval_split=train")
    train, held_out = load_data(d)
    assert (len(train), len(held_out)) == (7, 3)
    assert not {e.id for e in train} & {e.id for e in held_out}
    assert held_out == load_data(d)[1]  # the same seed holds out the same records
    assert {
        e.id
        for e in load_data(
            hub_config(*fields, "data.train_split=null", "data.eval_split=train", "data.seed=5")
        )[1]
    } != {e.id for e in held_out}
    first = train[0] if train[0].id.endswith(":0") else held_out[0]
    assert (first.question, first.answer, first.id) == ("What is 0 + 0?", "0", f"{path}:train:0")
    # Every column, untouched: the worked solution, a list, the number the gold was read from.
    assert first.columns == ROWS[0] and first.messages is None
    # A data file has one split, named train: with evaluation on, the default eval_split=test (not there)
    # carves it just the same, and one line says so.
    notes: list[str] = []
    monkeypatch.setattr(data_splits, "_say", notes.append)
    d = hub_config(*fields)
    assert load_data(d) == (train, held_out)
    assert notes == [
        f"data: {path} has one split, 'train', and no data.eval_split='test': 3 of its 10 records are held "
        "out by data.seed=1234, 7 trained on"
    ]
    # With evaluation off nothing is held out, and nothing is said.
    assert load_data(d, evaluate=False) == (
        sorted(train + held_out, key=lambda e: int(e.id.rsplit(":")[-1])),
        [],
    )
    assert len(notes) == 1


@pytest.mark.parametrize("suffix", ["parquet", "csv"])
def test_parquet_and_csv_files_load_through_their_builders(tmp_path, suffix):
    import datasets

    rows = [{k: v for k, v in r.items() if k != "tags"} for r in ROWS]
    path = tmp_path / f"sums.{suffix}"
    getattr(datasets.Dataset.from_list(rows), f"to_{suffix}")(str(path))
    d = hub_config(
        f"data.dataset={tmp_path}/*.{suffix}", "data.question_field=problem", "data.eval_split=null"
    )
    train, held_out = load_data(d)
    assert len(train) == 10 and held_out == [] and not has_eval_split(d)
    assert train[3].answer == "6" and train[3].columns["solution"] == "3 + 3 = 6"


def test_save_to_disk_folders(tmp_path):
    import datasets

    one = tmp_path / "one"
    datasets.Dataset.from_list(ROWS).save_to_disk(str(one))
    d = hub_config(f"data.dataset={one}", "data.question_field=problem", "data.eval_split=null")
    assert [e.answer for e in load_data(d)[0]] == [str(2 * i) for i in range(10)]

    both = tmp_path / "both"
    splits = {"train": datasets.Dataset.from_list(ROWS[:8]), "test": datasets.Dataset.from_list(ROWS[8:])}
    datasets.DatasetDict(splits).save_to_disk(str(both))
    d = hub_config(f"data.dataset={both}", "data.question_field=problem", "data.id_field=answer")
    train, held_out = load_data(d)
    assert [e.id for e in train] == [str(2 * i) for i in range(8)] and [e.id for e in held_out] == [
        "16",
        "18",
    ]
    # A split that is not there, of a dataset with several: a config error naming those there are.
    with pytest.raises(DataKeyError) as info:
        load_eval_split(
            hub_config(f"data.dataset={both}", "data.question_field=problem", "data.eval_split=validation")
        )
    assert str(info.value) == (
        f"data.eval_split='validation' is not a split of {both} (splits: train, test): data.eval_split=test, "
        "or eval.every_steps=0 (no evaluation: no held-out split)"
    )
    # The one split of a saved Dataset serves a held-out set too: data.eval_size of its records.
    assert len(load_eval_split(hub_config(f"data.dataset={one}", "data.question_field=problem"))) == 10


def test_a_missing_column_is_a_config_error_naming_the_likely_key(tmp_path):
    path = write_jsonl(tmp_path / "sums.jsonl", ROWS)
    where = f"{path} split 'train' (columns: problem, solution, answer, tags)"
    with pytest.raises(DataKeyError) as info:
        load_data(hub_config(f"data.dataset={path}", "data.eval_split=null"))
    assert isinstance(info.value, ConfigError)  # exit 2, as any config error
    assert (
        str(info.value)
        == f"data.question_field='prompt' is not a column of {where}: data.question_field=problem"
    )
    # Every problem of the dataset in one error.
    with pytest.raises(DataKeyError) as info:
        load_data(
            hub_config(
                f"data.dataset={path}", "data.answer_field=gold", "data.id_field=uid", "data.eval_split=null"
            )
        )
    assert str(info.value).split("; ") == [
        f"data.question_field='prompt' is not a column of {where}: data.question_field=problem",
        f"data.answer_field='gold' is not a column of {where}: data.answer_field=answer",
        f"data.id_field='uid' is not a column of {where}: data.id_field=null (ids: <dataset>:<split>:<row>, "
        "or <file>:<line>)",
    ]
    # A split that is not there and a column that is not in the other split: one error for both.
    with pytest.raises(DataKeyError) as info:
        load_data(hub_config(f"data.dataset={path}", "data.train_split=training", "data.eval_split=train"))
    assert str(info.value).split("; ") == [
        f"data.train_split='training' is not a split of {path} (splits: train): data.train_split=train "
        "(with evaluation on, data.eval_size of its records are held out by data.seed)",
        f"data.question_field='prompt' is not a column of {where}: data.question_field=problem",
    ]
    # A list that is not a conversation: the prompt keys, and what a conversation is.
    listed = write_jsonl(tmp_path / "listed.jsonl", [{"prompt": ["2 + 2?", "3 + 3?"], "answer": "4"}])
    with pytest.raises(DataKeyError) as info:
        load_data(hub_config(f"data.dataset={listed}", "data.eval_split=null"))
    assert str(info.value) == (
        f"data.question_field='prompt': the column in {listed} split 'train' holds a list, first item "
        "'2 + 2?', neither text nor a conversation (TRL's format: a list of {role, content} turns); a "
        "conversational prompt, in data.question_field or data.messages_field, is such a list"
    )
    # The same through a JSONL file of the hub source (data.train_path): its first line's keys.
    with pytest.raises(
        DataKeyError, match=r"data.question_field='prompt' is not a column of .*sums.jsonl \(line 1\)"
    ):
        load_data(hub_config(f"data.train_path={path}", "data.eval_split=null"))
    # A bad row names its row.
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"q": "a", "answer": "1"}, {"q": " ", "answer": "2"}])
    with pytest.raises(DataError, match=r"bad.jsonl split 'train' row 1: empty question field 'q'"):
        load_data(hub_config(f"data.dataset={bad}", "data.eval_split=null", "data.question_field=q"))
    skipped = hub_config(
        f"data.dataset={bad}", "data.eval_split=null", "data.question_field=q", "data.on_bad_record=skip"
    )
    assert [e.question for e in load_data(skipped)[0]] == ["a"]


@pytest.mark.parametrize("column", ["prompts", "completions", "completion_ids", "step"])
def test_a_column_named_like_the_reward_calls_own_arguments_is_refused(tmp_path, column):
    rows = [{"prompt": "Q", "answer": "1", column: 0}]
    path = write_jsonl(tmp_path / "clash.jsonl", rows)
    with pytest.raises(DataError, match=rf"{path} split 'train': column '{column}'"):
        load_data(hub_config(f"data.dataset={path}", "data.eval_split=null"))
    with pytest.raises(DataError, match=rf"clash.jsonl:1: column '{column}'"):  # whatever on_bad_record says
        load_jsonl(path, question_field="prompt", on_bad_record="skip")


def test_the_gold_answer_column(tmp_path):
    """answer_field null: the `answer` column when there is one holding text or a number, else no gold."""
    rows = [
        {"prompt": "Write a haiku.", "topic": "rain"},
        {"prompt": "2 + 2?", "answer": 4},
        {"prompt": "Name it.", "answer": ["a", "b"]},
        {"prompt": "Say x.", "answer": None, "solution": "x"},
    ]
    path = write_jsonl(tmp_path / "open.jsonl", rows)
    examples = load_data(hub_config(f"data.dataset={path}", "data.eval_split=null"))[0]
    assert [e.answer for e in examples] == ["", "4", "", ""]
    assert [e.columns["prompt"] for e in examples] == [r["prompt"] for r in rows]
    named = load_data(
        hub_config(
            f"data.dataset={path}",
            "data.eval_split=null",
            "data.answer_field=solution",
            "data.on_bad_record=skip",
        )
    )[0]
    assert [e.answer for e in named] == ["x"]  # a named column is required: the others are bad rows
    # A GSM8K gold is always read: answer_field null reads `answer`.
    gsm = write_jsonl(tmp_path / "gsm.jsonl", [{"question": "Q", "answer": "so #### 1,200"}])
    d = hub_config(
        f"data.dataset={gsm}",
        "data.eval_split=null",
        "data.question_field=question",
        "data.answer_format=gsm8k",
    )
    validate(
        compose_config(["data=hub", "eval.every_steps=0", f"data.dataset={gsm}", "data.answer_format=gsm8k"])
    )
    assert load_data(d)[0][0].answer == "1200"


CONVERSATIONS = [
    # A prompt column (TRL's conversational prompt): the turns are the prompt.
    {
        "prompt": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "2 + 2?"}],
        "answer": "4",
    },
    # A whole conversation ending with the assistant's answer: that last turn is not part of the prompt.
    {
        "prompt": [
            {"role": "user", "content": "1 + 1?"},
            {"role": "assistant", "content": "2"},
            {"role": "user", "content": "And 3 + 3?"},
            {"role": "assistant", "content": "6"},
        ],
        "answer": "6",
    },
]


def test_a_conversational_column_is_the_prompt(tmp_path):
    import datasets

    folder = tmp_path / "chats"
    datasets.Dataset.from_list(CONVERSATIONS).save_to_disk(str(folder))
    d = hub_config(
        f"data.dataset={folder}",
        "data.messages_field=prompt",
        "data.eval_split=null",
        "data.system_prompt='Think first.'",
        "data.prompt_template='{question} Box it.'",
        "+data.few_shot=[{role: user, content: demo}]",
    )
    terse, follow_up = load_data(d)[0]
    assert terse.question == "2 + 2?" and follow_up.question == "And 3 + 3?"
    assert [m["role"] for m in follow_up.messages] == ["user", "assistant", "user"]
    assert follow_up.columns["prompt"] == CONVERSATIONS[1]["prompt"]  # the column itself keeps every turn
    # Its own system turn stays alone; without one, data.system_prompt comes first; no template, no few-shot.
    assert chat_messages(d, terse) == CONVERSATIONS[0]["prompt"]
    assert chat_messages(d, follow_up) == [{"role": "system", "content": "Think first."}, *follow_up.messages]
    plain = Example("5 + 5?", "10", "p")
    assert (
        chat_messages(d, plain)
        == chat_messages(d, "5 + 5?")
        == [
            {"role": "system", "content": "Think first."},
            {"role": "user", "content": "demo"},
            {"role": "user", "content": "5 + 5? Box it."},
        ]
    )
    assert prompt_bytes(d, terse) == len("Be terse.2 + 2?")
    from grpo_run.models.tiny import build_tokenizer

    tok = build_tokenizer()
    expected = tok.apply_chat_template(
        chat_messages(d, follow_up), tokenize=False, add_generation_prompt=True
    )
    assert chat_prompts(tok, d, [follow_up]) == [expected] and "6" not in expected.rsplit("3 + 3", 1)[1]


@pytest.mark.parametrize(
    ("turns", "why"),
    [
        ("not turns", "must be a non-empty list"),
        ([{"role": "narrator", "content": "x"}], "turn 0 must be"),
        ([{"role": "system", "content": "x"}, {"role": "assistant", "content": "y"}], "holds no user turn"),
    ],
)
def test_bad_conversations_name_the_line(tmp_path, turns, why):
    good = {"messages": [{"role": "user", "content": "1 + 0?"}], "answer": "1"}
    path = write_jsonl(tmp_path / "chats.jsonl", [good, {"messages": turns, "answer": "1"}])
    with pytest.raises(DataError, match=f"chats.jsonl:2: messages field 'messages' {why}"):
        load_jsonl(path, messages_field="messages")


def test_a_text_column_named_as_messages_is_a_config_error(tmp_path):
    path = write_jsonl(tmp_path / "chats.jsonl", [{"messages": "2 + 2?", "answer": "4"}])
    with pytest.raises(DataKeyError) as info:
        load_jsonl(path, messages_field="messages")
    assert str(info.value) == (
        f"data.messages_field='messages': the column in {path} (line 1) holds text, not a conversation "
        "(TRL's format: a list of {role, content} turns): data.question_field=messages "
        "data.messages_field=null reads a text prompt"
    )


def test_hub_config_errors_name_the_key(tmp_path):
    def fails(*overrides):
        with pytest.raises(ConfigError) as info:
            validate(compose_config(["data=hub", "eval.every_steps=0", *overrides]))
        return str(info.value)

    assert fails().startswith("data.dataset=None: data.source=hub needs a hub id or a local path")
    assert fails("data.dataset=x", "data.answer_field=null", "data.entry_point_field=e").startswith(
        "data.entry_point_field='e'"
    )
    assert fails("data.dataset=x", "data.train_split=null", "data.eval_split=null").startswith(
        "data.train_split"
    )
    assert "data.eval_split" in fails("data.dataset=x", "data.eval_split=null", "eval.every_steps=5")
    validate(
        compose_config(
            ["data=hub", "eval.every_steps=0", "data.train_path=a.jsonl", "data.eval_path=b.jsonl"]
        )
    )


def test_no_file_under_conf_names_the_shared_folder():
    texts = {p: p.read_text() for p in (REPO / "conf").rglob("*.yaml")}
    assert texts and [p for p, t in texts.items() if "../shared" in t or "shared/data" in t] == []


# ---------------------------------------------------------------- offline, no cache: the one-line error


def test_a_hub_id_offline_without_cache_fails_fast():
    import datasets

    if not datasets.config.HF_HUB_OFFLINE:
        pytest.skip("needs HF_HUB_OFFLINE=1 when datasets is imported (tests/conftest.py sets it)")
    t = time.perf_counter()
    with pytest.raises(DataError, match="offline and not in the datasets cache"):
        load_data(compose_config(["data=gsm8k"]).data)
    assert time.perf_counter() - t < 10


def test_the_cli_says_what_to_do_in_one_line(tmp_path):
    """`grpo-run data=gsm8k` offline with an empty cache: exit 1, one line naming the dataset and the
    overrides, before any model is built (the default SmolLM2 would be converted first otherwise)."""
    empty = tmp_path / "hf"
    env = {k: v for k, v in os.environ.items() if k != "GRPO_RUN_DATA"}
    env |= {"HF_HOME": str(empty), "HF_DATASETS_CACHE": str(empty / "datasets"), "HF_HUB_OFFLINE": "1"}
    env["GRPO_RUN_CACHE"] = str(tmp_path / "grpo-cache")  # stays empty: no model is built
    args = ["data=gsm8k", "logger=console", "trainer.device=cpu", f"hydra.run.dir={tmp_path / 'run'}"]
    proc = subprocess.run([GRPO_RUN, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    lines = [line for line in out.splitlines() if "could not load dataset" in line]
    assert len(lines) == 1 and "Traceback" not in out, out
    assert lines[0].startswith(
        "grpo-run: could not load dataset 'openai/gsm8k' (config 'main', split 'train'): "
    )
    assert (
        "offline and not in the datasets cache" in lines[0] and "data.train_path/data.eval_path" in lines[0]
    )
    assert "GRPO_RUN_DATA to a folder holding gsm8k_train.jsonl and gsm8k_test.jsonl" in lines[0]
    assert not any((tmp_path / "grpo-cache").glob("*/config.json"))


# ---------------------------------------------------------------- the presets on the real files


needs_shared_data = pytest.mark.skipif(
    not (SHARED_DATA / "gsm8k_train.jsonl").is_file(), reason=f"needs the benchmark files in {SHARED_DATA}"
)


@needs_shared_data
@pytest.mark.parametrize(
    ("preset", "sizes", "first_id"),
    [
        ("gsm8k", (7473, 200), "gsm8k_train:1"),
        ("math500", (300, 200), "test/precalculus/807.json"),
        ("humaneval", (132, 32), "HumanEval/0"),
    ],
)
def test_presets_read_grpo_run_data(monkeypatch, preset, sizes, first_id):
    monkeypatch.setenv("GRPO_RUN_DATA", str(SHARED_DATA.resolve()))
    d = compose_config([f"data={preset}"]).data
    assert d.local_dir == str(SHARED_DATA.resolve())
    train, held_out = load_data(d)
    assert (len(train), len(held_out)) == sizes and train[0].id == first_id
    assert not {e.id for e in train} & {e.id for e in held_out}
    if preset == "gsm8k":  # the raw solution in columns, the parsed gold in answer
        assert train[0].answer == "72" and train[0].columns["answer"].endswith("#### 72")
    if preset == "humaneval":
        assert (
            train[0].answer.endswith("check(has_close_elements)") and "canonical_solution" in train[0].columns
        )


@needs_shared_data
def test_a_file_override_beats_grpo_run_data(monkeypatch, tmp_path):
    monkeypatch.setenv("GRPO_RUN_DATA", str(tmp_path))  # holds nothing: train_path/eval_path win
    path = SHARED_DATA / "gsm8k_test.jsonl"
    d = compose_config(["data=gsm8k", f"data.train_path={path}", f"data.eval_path={path}"]).data
    assert [len(s) for s in load_data(d)] == [1319, 200]
    with pytest.raises(DataError, match=r"gsm8k_train.jsonl: file not found \(GRPO_RUN_DATA="):
        load_data(compose_config(["data=gsm8k"]).data)
    with pytest.raises(DataError, match=r"gsm8k_train.jsonl: file not found \(data.local_dir="):
        load_data(compose_config(["data=gsm8k", f"data.local_dir={tmp_path / 'x'}"]).data)


def test_with_evaluation_off_no_held_out_split_is_required_or_read(tmp_path):
    import datasets

    both = tmp_path / "both"
    parts = {"train": datasets.Dataset.from_list(ROWS[:8]), "dev": datasets.Dataset.from_list(ROWS[8:])}
    datasets.DatasetDict(parts).save_to_disk(str(both))
    fields = [f"data.dataset={both}", "data.question_field=problem"]
    cfg = compose_config(["data=hub", "eval.every_steps=0", *fields])
    assert not evaluation_on(cfg) and evaluation_on(
        compose_config(["data=hub", "eval.every_steps=3", *fields])
    )
    assert evaluation_on(compose_config(["data=hub", "eval.every_steps=0", "mode=eval", *fields]))
    # eval_split=test is not there, and no file at eval_path: neither is looked for.
    train, held_out = load_data(cfg.data, evaluate=False)
    assert len(train) == 8 and held_out == []
    missing = hub_config(*fields, f"data.eval_path={tmp_path / 'missing.jsonl'}")
    assert len(load_data(missing, evaluate=False)[0]) == 8
    jsonl = write_jsonl(tmp_path / "sums.jsonl", ROWS)
    no_file = f"data.eval_path={tmp_path / 'no.jsonl'}"
    plain = compose_config(["data=jsonl", f"data.train_path={jsonl}", no_file, "data.question_field=problem"])
    assert len(load_data(plain.data, evaluate=False)[0]) == 10
    # With evaluation on, the split that is not there is a config error naming the likely one.
    with pytest.raises(
        DataKeyError,
        match=r"data.eval_split='test' is not a split of .* \(splits: train, dev\): data.eval_split=dev",
    ):
        load_data(cfg.data)


def test_a_key_missing_from_both_splits_is_named_once(tmp_path):
    import datasets

    both = tmp_path / "both"
    parts = {"train": datasets.Dataset.from_list(ROWS[:8]), "test": datasets.Dataset.from_list(ROWS[8:])}
    datasets.DatasetDict(parts).save_to_disk(str(both))
    with pytest.raises(DataKeyError) as info:
        load_data(hub_config(f"data.dataset={both}"))
    assert str(info.value) == (
        f"data.question_field='prompt' is not a column of {both} split 'train' (columns: problem, solution, "
        "answer, tags): data.question_field=problem"
    )
