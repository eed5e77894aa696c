"""grpo_run.data.sources (load_split) and the real benchmark files in ../shared/data, when present."""

import json
import re
from fractions import Fraction
from pathlib import Path

import pytest

from grpo_run.data import DataError, DataSource, Example, arithmetic_splits, load_jsonl, load_split

SHARED_DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"
NUMBER = re.compile(r"^-?\d+(\.\d+)?$")


def _write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


@pytest.fixture
def gsm8k_files(tmp_path):
    def records(prefix, n):
        return [{"question": f"{prefix} {i}", "answer": f"work\n#### {i * 1000:,}"} for i in range(n)]

    return (
        _write_jsonl(tmp_path / "train.jsonl", records("train", 20)),
        _write_jsonl(tmp_path / "test.jsonl", records("test", 8)),
    )


@pytest.fixture
def math500_file(tmp_path):
    records = [
        {
            "problem": f"p{i}",
            "solution": "...",
            "answer": f"\\frac{{{i}}}{{2}}",
            "unique_id": f"test/x/{i}.json",
        }
        for i in range(30)
    ]
    return _write_jsonl(tmp_path / "math500.jsonl", records)


# The presets' record options (conf/data/gsm8k.yaml, math500.yaml), as load_split takes them.
GSM8K = {"dataset": "openai/gsm8k", "config": "main", "answer_format": "gsm8k"}
MATH500 = {
    "dataset": "HuggingFaceH4/MATH-500",
    "train_split": None,
    "question_field": "problem",
    "id_field": "unique_id",
}


@pytest.fixture
def hub_calls(monkeypatch):
    """`datasets.load_dataset` answering a hub id with rows given per split; records the calls."""
    import datasets

    calls, splits = [], {}

    def load_dataset(*args, **kwargs):
        calls.append((args, kwargs))
        if kwargs["split"] not in splits:
            raise ConnectionError("Couldn't reach the Hub (OfflineModeIsEnabled)")
        return datasets.Dataset.from_list(splits[kwargs["split"]])

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    return calls, splits


def test_source_names():
    assert [s.value for s in DataSource] == ["arithmetic", "jsonl", "hub", "reasoning_gym"]
    assert DataSource("hub") == "hub"
    with pytest.raises(ValueError):
        load_split("gsm8k", split="train")  # a preset of hub now, not a source
    with pytest.raises(ValueError):
        load_split("arithmetic", split="validation", eval_size=1, train_size=1)


def test_arithmetic_source_matches_arithmetic_splits():
    knobs = {"operations": ("+", "*"), "num_operands": 3}
    train = load_split("arithmetic", split="train", seed=3, train_size=40, eval_size=10, **knobs)
    evaluation = load_split(DataSource.ARITHMETIC, split="eval", seed=3, eval_size=10, **knobs)
    assert (train, evaluation) == arithmetic_splits(seed=3, train_size=40, eval_size=10, **knobs)
    assert train[0].columns == {"question": train[0].question, "answer": train[0].answer}


def test_arithmetic_source_argument_errors(tmp_path):
    with pytest.raises(DataError, match="eval_size"):
        load_split("arithmetic", split="train", train_size=5)
    with pytest.raises(DataError, match="no path"):
        load_split("arithmetic", split="eval", eval_size=5, eval_path=tmp_path / "x.jsonl")


def test_local_files_win_over_the_hub(gsm8k_files, hub_calls):
    train_path, eval_path = gsm8k_files
    train = load_split("hub", split="train", train_path=train_path, eval_path=eval_path, **GSM8K)
    evaluation = load_split("hub", split="eval", train_path=train_path, eval_path=eval_path, **GSM8K)
    assert len(train) == 20 and len(evaluation) == 8 and hub_calls[0] == []
    assert (train[3].question, train[3].answer, train[3].id) == ("train 3", "3000", "train:4")
    # The raw columns, worked solution included; the parsed gold stays in answer.
    assert train[3].columns == {"question": "train 3", "answer": "work\n#### 3,000"}


def test_a_local_dir_stands_in_for_the_hub(gsm8k_files, hub_calls, monkeypatch):
    folder = gsm8k_files[0].parent
    files = {"local_dir": str(folder), "local_files": {"train": "train.jsonl", "eval": "test.jsonl"}}
    assert len(load_split("hub", split="eval", **GSM8K, **files)) == 8
    assert len(load_split("hub", split="train", **GSM8K, **files)) == 20
    # A missing file names where the folder came from: the environment variable, or data.local_dir itself.
    nope = {**files, "local_dir": "/nope"}
    monkeypatch.setenv("GRPO_RUN_DATA", "/nope")
    with pytest.raises(DataError, match="test.jsonl") as info:  # train_path wins, the folder's eval is used
        load_split("hub", split="eval", train_path=gsm8k_files[0], **GSM8K, **nope)
    assert (
        "(GRPO_RUN_DATA=/nope (data.local_dir's default) holds the preset's local files; unset GRPO_RUN_DATA"
        in str(info.value)
    )
    monkeypatch.setenv("GRPO_RUN_DATA", str(folder))
    with pytest.raises(DataError, match="test.jsonl") as info:
        load_split("hub", split="eval", train_path=gsm8k_files[0], **GSM8K, **nope)
    assert "(data.local_dir=/nope holds the preset's local files; set data.local_dir=null" in str(info.value)
    assert "GRPO_RUN_DATA" not in str(info.value)
    # No file named for a split: that split comes from the dataset (offline here: not cached).
    with pytest.raises(DataError, match="offline and not in the datasets cache"):
        load_split("hub", split="train", **GSM8K, local_dir=str(folder), local_files={"eval": "test.jsonl"})
    assert hub_calls[0] == [(("openai/gsm8k", "main"), {"split": "train"})]


def test_size_caps_are_seeded_subsets_in_file_order(gsm8k_files):
    train_path, _ = gsm8k_files
    a = load_split("hub", split="train", seed=1, train_size=5, train_path=train_path, **GSM8K)
    b = load_split("hub", split="train", seed=1, train_size=5, train_path=train_path, **GSM8K)
    c = load_split("hub", split="train", seed=2, train_size=5, train_path=train_path, **GSM8K)
    assert a == b and a != c and len(a) == 5
    lines = [int(ex.id.split(":")[1]) for ex in a]
    assert lines == sorted(lines)


def test_missing_split_path_is_named(gsm8k_files):
    train_path, _ = gsm8k_files
    with pytest.raises(DataError, match="eval_path"):
        load_split("jsonl", split="eval", train_path=train_path)


def test_path_and_split_paths_are_exclusive(gsm8k_files):
    train_path, eval_path = gsm8k_files
    with pytest.raises(DataError, match="not both"):
        load_split("jsonl", split="train", path=train_path, eval_path=eval_path)
    with pytest.raises(DataError, match="train_split=None"):
        load_split("hub", split="train", path=train_path, **GSM8K)


def test_one_file_is_carved_into_disjoint_splits(gsm8k_files):
    path, _ = gsm8k_files
    common = {"seed": 7, "path": path, "eval_size": 6}
    train = load_split("jsonl", split="train", answer_format="gsm8k", **common)
    evaluation = load_split("jsonl", split="eval", answer_format="gsm8k", **common)
    assert len(train) == 14 and len(evaluation) == 6
    assert not {ex.id for ex in train} & {ex.id for ex in evaluation}
    with pytest.raises(DataError, match="eval_size is required"):
        load_split("jsonl", split="train", path=path)


def test_jsonl_source_passes_options(tmp_path):
    path = _write_jsonl(tmp_path / "aime.jsonl", [{"id": 60, "problem": "P", "answer": "025"}, {"bad": 1}])
    examples = load_split(
        "jsonl", split="eval", eval_path=path, question_field="problem", id_field="id", on_bad_record="skip"
    )
    assert examples == [Example("P", "025", "60", {"id": 60, "problem": "P", "answer": "025"})]


def test_a_hub_id_not_cached_offline_explains_the_overrides(hub_calls):
    files = {"local_files": {"train": "gsm8k_train.jsonl", "eval": "gsm8k_test.jsonl"}}
    with pytest.raises(DataError) as info:
        load_split("hub", split="eval", **GSM8K, **files)
    message = str(info.value)
    assert message.startswith("could not load dataset 'openai/gsm8k' (config 'main', split 'test'): offline")
    assert "data.train_path/data.eval_path" in message and "OfflineModeIsEnabled" in message
    assert "GRPO_RUN_DATA to a folder holding gsm8k_train.jsonl and gsm8k_test.jsonl" in message
    assert "\n" not in message
    assert hub_calls[0] == [(("openai/gsm8k", "main"), {"split": "test"})]


def test_hub_records_are_parsed(hub_calls):
    _, splits = hub_calls
    splits["train"] = [{"question": "Q1", "answer": "x\n#### 1,080"}, {"question": "Q2", "answer": "#### 7"}]
    examples = load_split("hub", split="train", **GSM8K, evaluate=False)  # only a train split here
    assert [(e.question, e.answer, e.id) for e in examples] == [
        ("Q1", "1080", "openai/gsm8k:train:0"),
        ("Q2", "7", "openai/gsm8k:train:1"),
    ]
    assert examples[0].columns == splits["train"][0]


def test_math500_eval_keeps_latex_and_unique_ids(math500_file):
    examples = load_split("hub", split="eval", eval_path=math500_file, **{**MATH500, "train_split": "x"})
    assert len(examples) == 30
    e = examples[4]
    assert (e.question, e.answer, e.id) == ("p4", "\\frac{4}{2}", "test/x/4.json")
    assert set(e.columns) == {"problem", "solution", "answer", "unique_id"}


def test_math500_train_is_carved_from_the_test_file(math500_file):
    common = {"seed": 0, "eval_size": 10, **MATH500}
    train = load_split("hub", split="train", eval_path=math500_file, **common)
    evaluation = load_split("hub", split="eval", eval_path=math500_file, **common)
    fields = {"question_field": "problem", "id_field": "unique_id"}
    same_via_path = load_split("jsonl", split="eval", path=math500_file, seed=0, eval_size=10, **fields)
    assert len(train) == 20 and len(evaluation) == 10
    assert [e.id for e in evaluation] == [e.id for e in same_via_path]
    assert not {ex.id for ex in train} & {ex.id for ex in evaluation}
    with pytest.raises(DataError, match="eval_size is required"):
        load_split("hub", split="train", eval_path=math500_file, **MATH500)
    with pytest.raises(DataError, match="leaves no training records"):
        load_split("hub", split="train", eval_path=math500_file, **{**common, "eval_size": 30})
    # An explicit training file wins over carving.
    assert len(load_split("hub", split="train", train_path=math500_file, **common)) == 30


def test_file_errors_surface_through_load_split(tmp_path):
    with pytest.raises(DataError, match=re.escape(str(tmp_path / "missing.jsonl"))):
        load_split("hub", split="train", train_path=tmp_path / "missing.jsonl", **GSM8K)


# ---------------------------------------------------------------- the real files, when present

needs_shared_data = pytest.mark.skipif(
    not SHARED_DATA.is_dir(), reason=f"real benchmark data not found at {SHARED_DATA}"
)


@needs_shared_data
@pytest.mark.parametrize(("name", "count"), [("gsm8k_train", 7473), ("gsm8k_test", 1319)])
def test_real_gsm8k_golds_are_numbers(name, count):
    result = load_jsonl(SHARED_DATA / f"{name}.jsonl", answer_format="gsm8k")
    assert result.skipped == 0 and len(result.examples) == count
    for ex in result.examples:
        assert NUMBER.match(ex.answer), (ex.id, ex.answer)
        Fraction(ex.answer)


@needs_shared_data
def test_real_gsm8k_through_load_split():
    path = SHARED_DATA / "gsm8k_train.jsonl"
    train = load_split("hub", split="train", train_path=path, train_size=100, **GSM8K)
    assert len(train) == 100


@needs_shared_data
def test_real_math500_answers_present():
    path = SHARED_DATA / "math500_test.jsonl"
    examples = load_split("hub", split="eval", eval_path=path, **{**MATH500, "train_split": "x"})
    assert len(examples) == 500 and len({ex.id for ex in examples}) == 500
    assert all(ex.answer.strip() and ex.question.strip() for ex in examples)


@needs_shared_data
@pytest.mark.parametrize(("name", "count"), [("aime24_test", 30), ("amc23_test", 40)])
def test_real_competition_files_load_as_jsonl(name, count):
    examples = load_split(
        "jsonl",
        split="eval",
        eval_path=SHARED_DATA / f"{name}.jsonl",
        question_field="problem",
        id_field="id",
    )
    assert len(examples) == count
    for ex in examples:
        Fraction(ex.answer)  # "025" and 27.0 -> "27" are both plain numbers
