"""grpo_run.data: arithmetic generator, JSONL loading and its errors, prompt sampler."""

import json
import re

import pytest

from grpo_run.data import (
    DataError,
    Example,
    PromptSampler,
    arithmetic_splits,
    generate_arithmetic,
    gsm8k_final_answer,
    load_jsonl,
)
from grpo_run.data.arithmetic import evaluate

EXPRESSION = re.compile(r"^What is ([0-9+\-* ]+)\?$")


def _python_value(question: str) -> int:
    match = EXPRESSION.match(question)
    assert match, question
    # The expression is our own digits and + - *, so Python's own evaluator is a safe reference.
    return eval(match.group(1), {"__builtins__": {}})


# ---------------------------------------------------------------- arithmetic


def test_evaluate_precedence_worked_numbers():
    assert evaluate([2, 3, 4], ["+", "*"]) == 14  # 2 + (3*4) = 14, not (2+3)*4 = 20
    assert evaluate([10, 2, 3], ["-", "*"]) == 4  # 10 - 6
    assert evaluate([10, 2, 3], ["-", "-"]) == 5  # left to right: (10-2)-3, not 10-(2-3) = 11
    assert evaluate([2, 3, 4, 5], ["*", "+", "*"]) == 26  # 6 + 20
    assert evaluate([7, 8], ["-"]) == -1


def test_generate_is_deterministic_and_seed_dependent():
    a = generate_arithmetic(50, seed=3, operations=("+", "-", "*"), num_operands=3)
    b = generate_arithmetic(50, seed=3, operations=("+", "-", "*"), num_operands=3)
    c = generate_arithmetic(50, seed=4, operations=("+", "-", "*"), num_operands=3)
    assert a == b
    assert a != c
    # A smaller request is a prefix of a larger one.
    assert generate_arithmetic(20, seed=3, operations=("+", "-", "*"), num_operands=3) == a[:20]


@pytest.mark.parametrize("num_operands", [2, 3, 4])
def test_generated_answers_match_python_eval(num_operands):
    examples = generate_arithmetic(200, seed=0, num_operands=num_operands, operations=("+", "-", "*"))
    assert len(examples) == 200
    for ex in examples:
        assert isinstance(ex, Example)
        assert ex.answer == str(_python_value(ex.question))
        assert int(ex.answer) >= 0  # allow_negative=False by default


def test_negative_results_only_when_allowed():
    examples = generate_arithmetic(300, seed=1, operations=("-",), allow_negative=True)
    values = [int(ex.answer) for ex in examples]
    assert min(values) < 0
    assert all(int(ex.answer) == _python_value(ex.question) for ex in examples)


def test_digit_range_and_operations_respected():
    examples = generate_arithmetic(100, seed=2, min_digits=2, max_digits=3, operations=("*",))
    for ex in examples:
        operands = [int(tok) for tok in re.findall(r"\d+", ex.question)]
        assert all(10 <= x <= 999 for x in operands)
        assert "+" not in ex.question and "-" not in ex.question


def test_no_duplicate_questions_and_unique_ids():
    examples = generate_arithmetic(150, seed=5, max_digits=1, operations=("+", "-", "*"))
    assert len({ex.question for ex in examples}) == 150
    assert len({ex.id for ex in examples}) == 150


def test_too_small_a_space_raises():
    # One-digit a + b has only 81 distinct questions.
    with pytest.raises(ValueError, match="distinct"):
        generate_arithmetic(82, seed=0, max_digits=1, operations=("+",))


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_operands": 1},
        {"min_digits": 0},
        {"min_digits": 3, "max_digits": 2},
        {"operations": ()},
        {"operations": ("/",)},
        {"word_problem_fraction": 1.5},
    ],
)
def test_bad_knobs_raise(kwargs):
    with pytest.raises(ValueError):
        generate_arithmetic(5, seed=0, **kwargs)


def test_word_problems():
    examples = generate_arithmetic(200, seed=7, operations=("+", "-", "*"), word_problem_fraction=1.0)
    for ex in examples:
        assert not ex.question.startswith("What is"), ex.question
        assert ex.question.endswith("?")
        numbers = [int(tok) for tok in re.findall(r"\d+", ex.question)]
        assert len(numbers) == 2
        a, b = numbers
        assert int(ex.answer) in {a + b, a - b, a * b}
        assert int(ex.answer) >= 0
    # Worked example of one template: "has {a} and gives {b}" -> a - b.
    gives = [ex for ex in examples if "gives" in ex.question]
    assert gives
    for ex in gives:
        a, b = (int(tok) for tok in re.findall(r"\d+", ex.question))
        assert int(ex.answer) == a - b


def test_word_problem_fraction_mixes_kinds():
    examples = generate_arithmetic(400, seed=8, word_problem_fraction=0.5)
    words = sum(not ex.question.startswith("What is") for ex in examples)
    assert 120 < words < 280


def test_splits_are_disjoint_and_eval_is_stable():
    knobs = {"operations": ("+", "-", "*"), "word_problem_fraction": 0.3}
    train, evaluation = arithmetic_splits(seed=11, train_size=300, eval_size=60, **knobs)
    assert len(train) == 300 and len(evaluation) == 60
    assert not {ex.question for ex in train} & {ex.question for ex in evaluation}
    assert not {ex.id for ex in train} & {ex.id for ex in evaluation}
    # The eval set depends only on seed, eval_size and knobs, not on train_size.
    _, evaluation_again = arithmetic_splits(seed=11, train_size=10, eval_size=60, **knobs)
    assert evaluation_again == evaluation


def test_splits_disjoint_even_in_a_small_space():
    # 81 one-digit additions: 60 train + 20 eval must use 80 of them without overlap.
    train, evaluation = arithmetic_splits(
        seed=0, train_size=60, eval_size=20, max_digits=1, operations=("+",)
    )
    assert not {ex.question for ex in train} & {ex.question for ex in evaluation}


# ---------------------------------------------------------------- jsonl


def _write(tmp_path, lines, name="data.jsonl"):
    path = tmp_path / name
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def _record(question="What is 1 + 1?", answer="2", **extra):
    return json.dumps({"question": question, "answer": answer, **extra})


def test_load_good_file_with_blank_lines(tmp_path):
    path = _write(tmp_path, [_record(), "", "   ", _record("Q2", "  \\frac{1}{2} ")])
    result = load_jsonl(path)
    assert result.skipped == 0
    assert result.examples == [
        Example("What is 1 + 1?", "2", "data:1", {"question": "What is 1 + 1?", "answer": "2"}),
        Example("Q2", "\\frac{1}{2}", "data:4", {"question": "Q2", "answer": "  \\frac{1}{2} "}),
    ]


def test_custom_fields_ids_and_numeric_answers(tmp_path):
    lines = [
        json.dumps({"problem": "P1", "answer": 27.0, "id": 3}),
        json.dumps({"problem": "P2", "answer": 0.5, "id": 9}),
        json.dumps({"problem": "P3", "answer": "025", "id": 10}),
    ]
    result = load_jsonl(_write(tmp_path, lines), question_field="problem", id_field="id")
    assert [(ex.answer, ex.id) for ex in result.examples] == [("27", "3"), ("0.5", "9"), ("025", "10")]


@pytest.mark.parametrize(
    ("solution", "gold"),
    [
        ("She makes 9 * 2 = <<9*2=18>>18 dollars.\n#### 18", "18"),
        ("... #### 1,234", "1234"),
        ("#### 1,234,567 ", "1234567"),
        ("a #### 5 then #### -3.5", "-3.5"),  # the last marker wins
    ],
)
def test_gsm8k_final_answer(solution, gold):
    assert gsm8k_final_answer(solution) == gold


def test_load_gsm8k_format(tmp_path):
    path = _write(tmp_path, [_record("Q", "Work...\n#### 1,234")])
    assert load_jsonl(path, answer_format="gsm8k").examples[0].answer == "1234"


@pytest.mark.parametrize(
    ("bad_line", "why", "kwargs"),
    [
        ("{not json", "not valid JSON", {}),
        ("[1, 2]", "expected a JSON object", {}),
        ('"just a string"', "expected a JSON object", {}),
        (json.dumps({"answer": "2"}), "missing question field 'question'", {}),
        (json.dumps({"question": "Q"}), "missing answer field 'answer'", {}),
        (_record(question="  "), "empty question", {}),
        (_record(answer=""), "empty answer", {}),
        (_record(answer=None), "answer field 'answer' must be a string or number", {}),
        (_record(answer="no marker 42"), "no '####'", {"answer_format": "gsm8k"}),
        (_record(answer="text ####  "), "empty after '####'", {"answer_format": "gsm8k"}),
        (_record(), "missing id field 'uid'", {"id_field": "uid"}),
    ],
)
def test_bad_record_names_file_and_line(tmp_path, bad_line, why, kwargs):
    good = _record(answer="x #### 1", uid="a")
    path = _write(tmp_path, [good, "", bad_line, good.replace('"a"', '"b"')])
    with pytest.raises(DataError) as info:
        load_jsonl(path, **kwargs)
    message = str(info.value)
    assert f"{path}:3:" in message  # line 3 (the blank line 2 still counts)
    assert why in message


def test_invalid_utf8_names_line(tmp_path):
    path = tmp_path / "bin.jsonl"
    path.write_bytes(_record().encode() + b"\n" + b'{"question": "\xff", "answer": "1"}\n')
    with pytest.raises(DataError, match=re.escape(f"{path}:2: not valid UTF-8")):
        load_jsonl(path)


def test_duplicate_id_names_line(tmp_path):
    path = _write(tmp_path, [_record(uid=1), _record(uid=2), _record(uid=1)])
    with pytest.raises(DataError, match=re.escape(f"{path}:3: duplicate id '1'")):
        load_jsonl(path, id_field="uid")


def test_missing_file_names_file(tmp_path):
    path = tmp_path / "nope.jsonl"
    with pytest.raises(DataError, match=re.escape(f"{path}: file not found")):
        load_jsonl(path)


@pytest.mark.parametrize("content", ["", "\n\n  \n"])
def test_empty_file_names_file(tmp_path, content):
    path = tmp_path / "empty.jsonl"
    path.write_text(content)
    with pytest.raises(DataError, match=re.escape(f"{path}: no records")):
        load_jsonl(path)


def test_skip_mode_counts_bad_lines(tmp_path):
    path = _write(
        tmp_path, [_record(), "{oops", "", "[1]", _record("Q2", "3"), json.dumps({"question": "Q"})]
    )
    result = load_jsonl(path, on_bad_record="skip")
    assert [ex.question for ex in result.examples] == ["What is 1 + 1?", "Q2"]
    assert result.skipped == 3
    assert [reason.split(": ")[0] for reason in result.skip_reasons] == [
        f"{path}:2",
        f"{path}:4",
        f"{path}:6",
    ]


def test_skip_mode_with_nothing_valid_names_file(tmp_path):
    path = _write(tmp_path, ["{oops", "[1]"])
    with pytest.raises(DataError, match=re.escape(f"{path}: no valid records")):
        load_jsonl(path, on_bad_record="skip")


def test_unknown_policy_or_format_is_rejected(tmp_path):
    path = _write(tmp_path, [_record()])
    with pytest.raises(ValueError):
        load_jsonl(path, on_bad_record="ignore")
    with pytest.raises(ValueError):
        load_jsonl(path, answer_format="latex")


# ---------------------------------------------------------------- sampler


def _examples(n):
    return [Example(question=f"q{i}", answer=str(i), id=str(i)) for i in range(n)]


def _ids(batches):
    return [[ex.id for ex in batch] for batch in batches]


def test_sampler_epochs_cover_each_example_once_and_reshuffle():
    sampler = PromptSampler(_examples(12), seed=0, batch_size=4)
    epoch0 = [ex.id for _ in range(3) for ex in sampler.next_batch()]
    epoch1 = [ex.id for _ in range(3) for ex in sampler.next_batch()]
    assert sorted(epoch0) == sorted(epoch1) == sorted(str(i) for i in range(12))
    assert epoch0 != epoch1
    assert sampler.epoch == 1


def test_sampler_drops_the_remainder_without_repeats():
    sampler = PromptSampler(_examples(10), seed=1, batch_size=4)
    assert sampler.batches_per_epoch == 2
    for _ in range(20):
        batch = sampler.next_batch()
        assert len(batch) == 4 and len({ex.id for ex in batch}) == 4
    assert sampler.epoch == 9  # 2 batches per epoch: batches 19 and 20 are epoch 9


def test_sampler_is_deterministic_and_seeded():
    samplers = [PromptSampler(_examples(30), seed=seed, batch_size=7) for seed in (5, 5, 6)]
    seqs = [_ids(sampler.next_batch() for _ in range(10)) for sampler in samplers]
    assert seqs[0] == seqs[1]
    assert seqs[0] != seqs[2]


@pytest.mark.parametrize("stop_after", [0, 1, 3, 4, 9])
def test_sampler_resume_matches_uninterrupted_run(stop_after):
    examples = _examples(17)
    uninterrupted = PromptSampler(examples, seed=42, batch_size=4)
    expected = _ids(uninterrupted.next_batch() for _ in range(15))

    first = PromptSampler(examples, seed=42, batch_size=4)
    got = _ids(first.next_batch() for _ in range(stop_after))
    state = json.loads(json.dumps(first.state_dict()))  # survives a checkpoint round trip
    assert set(state) >= {"seed", "epoch", "position"}

    # The resumed sampler is built with another seed: the state's seed wins.
    resumed = PromptSampler(examples, seed=0, batch_size=4)
    resumed.load_state_dict(state)
    got += _ids(resumed.next_batch() for _ in range(15 - stop_after))
    assert got == expected
    assert resumed.state_dict() == uninterrupted.state_dict()


def test_sampler_refuses_state_from_other_data():
    state = PromptSampler(_examples(10), seed=0, batch_size=2).state_dict()
    with pytest.raises(ValueError, match="examples"):
        PromptSampler(_examples(11), seed=0, batch_size=2).load_state_dict(state)
    with pytest.raises(ValueError, match="batch_size"):
        PromptSampler(_examples(10), seed=0, batch_size=5).load_state_dict(state)


@pytest.mark.parametrize(("n", "batch_size"), [(0, 1), (3, 0), (3, 4)])
def test_sampler_bad_arguments(n, batch_size):
    with pytest.raises(ValueError):
        PromptSampler(_examples(n), seed=0, batch_size=batch_size)


def test_few_shot_turns_come_between_the_system_prompt_and_the_question():
    from grpo_run.config.schema import ChatMessage, DataConfig
    from grpo_run.data.prompts import chat_prompts
    from grpo_run.models.tiny import build_tokenizer

    tok = build_tokenizer()
    data = DataConfig(
        system_prompt="Be brief.",
        prompt_template="{question} Answer.",
        few_shot=[
            ChatMessage("user", "What is 2 * 3?"),
            ChatMessage("assistant", "<calc>2*3</calc>"),
            ChatMessage("tool", "6"),
            ChatMessage("assistant", "6"),
        ],
    )
    (prompt,) = chat_prompts(tok, data, ["What is 4 * 5?"])
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2 * 3?"},
        {"role": "assistant", "content": "<calc>2*3</calc>"},
        {"role": "tool", "content": "6"},
        {"role": "assistant", "content": "6"},
        {"role": "user", "content": "What is 4 * 5? Answer."},
    ]
    assert prompt == tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt.index("<calc>2*3</calc>") < prompt.index("What is 4 * 5?")
