"""grpo_run.data.sources (load_split) and the real benchmark files in ../shared/data, when present."""

import json
import re
import sys
import types
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


@pytest.fixture
def offline_hub(monkeypatch):
    """A fake `datasets` module whose load_dataset fails like an offline hub; records the calls."""
    calls = []

    def load_dataset(*args, **kwargs):
        calls.append((args, kwargs))
        raise ConnectionError("offline")

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    return calls


def test_source_names():
    assert [s.value for s in DataSource] == ["arithmetic", "jsonl", "gsm8k", "math500", "humaneval"]
    assert DataSource("gsm8k") == "gsm8k"
    with pytest.raises(ValueError):
        load_split("mnist", split="train")
    with pytest.raises(ValueError):
        load_split("arithmetic", split="validation", eval_size=1, train_size=1)


def test_arithmetic_source_matches_arithmetic_splits():
    knobs = {"operations": ("+", "*"), "num_operands": 3}
    train = load_split("arithmetic", split="train", seed=3, train_size=40, eval_size=10, **knobs)
    evaluation = load_split(DataSource.ARITHMETIC, split="eval", seed=3, eval_size=10, **knobs)
    assert (train, evaluation) == arithmetic_splits(seed=3, train_size=40, eval_size=10, **knobs)


def test_arithmetic_source_argument_errors(tmp_path):
    with pytest.raises(DataError, match="eval_size"):
        load_split("arithmetic", split="train", train_size=5)
    with pytest.raises(DataError, match="no path"):
        load_split("arithmetic", split="eval", eval_size=5, eval_path=tmp_path / "x.jsonl")


def test_gsm8k_local_files(gsm8k_files):
    train_path, eval_path = gsm8k_files
    train = load_split("gsm8k", split="train", train_path=train_path, eval_path=eval_path)
    evaluation = load_split("gsm8k", split="eval", train_path=train_path, eval_path=eval_path)
    assert len(train) == 20 and len(evaluation) == 8
    assert train[3] == Example(question="train 3", answer="3000", id="train:4")


def test_size_caps_are_seeded_subsets_in_file_order(gsm8k_files):
    train_path, _ = gsm8k_files
    a = load_split("gsm8k", split="train", seed=1, train_size=5, train_path=train_path)
    b = load_split("gsm8k", split="train", seed=1, train_size=5, train_path=train_path)
    c = load_split("gsm8k", split="train", seed=2, train_size=5, train_path=train_path)
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
        load_split("gsm8k", split="train", path=train_path, eval_path=eval_path)


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
    assert examples == [Example(question="P", answer="025", id="60")]


def test_gsm8k_without_path_uses_hub_and_explains_failure(offline_hub):
    with pytest.raises(DataError) as info:
        load_split("gsm8k", split="eval")
    message = str(info.value)
    assert "'openai/gsm8k'" in message and "HF_HUB_OFFLINE" in message and "eval_path" in message
    assert offline_hub == [(("openai/gsm8k", "main"), {"split": "test"})]


def test_gsm8k_hub_records_are_parsed(monkeypatch):
    rows = [{"question": "Q1", "answer": "x\n#### 1,080"}, {"question": "Q2", "answer": "#### 7"}]
    fake = types.SimpleNamespace(load_dataset=lambda *a, **k: rows)
    monkeypatch.setitem(sys.modules, "datasets", fake)
    assert load_split("gsm8k", split="train") == [
        Example("Q1", "1080", "openai/gsm8k:train:0"),
        Example("Q2", "7", "openai/gsm8k:train:1"),
    ]


def test_math500_eval_keeps_latex_and_unique_ids(math500_file):
    examples = load_split("math500", split="eval", eval_path=math500_file)
    assert len(examples) == 30
    assert examples[4] == Example(question="p4", answer="\\frac{4}{2}", id="test/x/4.json")


def test_math500_train_is_carved_from_the_test_file(math500_file):
    common = {"seed": 0, "eval_size": 10}
    train = load_split("math500", split="train", eval_path=math500_file, **common)
    evaluation = load_split("math500", split="eval", eval_path=math500_file, **common)
    same_via_path = load_split("math500", split="eval", path=math500_file, **common)
    assert len(train) == 20 and len(evaluation) == 10 and evaluation == same_via_path
    assert not {ex.id for ex in train} & {ex.id for ex in evaluation}
    with pytest.raises(DataError, match="eval_size is required"):
        load_split("math500", split="train", eval_path=math500_file)
    with pytest.raises(DataError, match="only a test split"):
        load_split("math500", split="train", train_path=math500_file, eval_size=5)
    with pytest.raises(DataError, match="leaves no training records"):
        load_split("math500", split="train", eval_path=math500_file, eval_size=30)


def test_math500_without_path_explains_failure(offline_hub):
    with pytest.raises(DataError, match="'HuggingFaceH4/MATH-500'"):
        load_split("math500", split="eval")


def test_file_errors_surface_through_load_split(tmp_path):
    with pytest.raises(DataError, match=re.escape(str(tmp_path / "missing.jsonl"))):
        load_split("gsm8k", split="train", train_path=tmp_path / "missing.jsonl")


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
    train = load_split("gsm8k", split="train", train_path=SHARED_DATA / "gsm8k_train.jsonl", train_size=100)
    assert len(train) == 100


@needs_shared_data
def test_real_math500_answers_present():
    examples = load_split("math500", split="eval", eval_path=SHARED_DATA / "math500_test.jsonl")
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
