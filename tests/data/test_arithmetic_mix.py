"""data.arithmetic.mix: difficulty buckets split by share, each drawn from its own seeded stream, tagged with
a `difficulty` column, disjoint within and across buckets and splits; and the config checks of the mix."""

import re
from collections import Counter

import pytest

from grpo_run.config import ConfigError
from grpo_run.data import arithmetic_splits, load_split
from grpo_run.data.arithmetic import largest_remainder
from tests.builders import compose_config

MIX = [
    {"name": "easy", "share": 0.5, "max_digits": 1, "operations": ["+"]},
    {"name": "mid", "share": 0.3},  # the top-level knobs
    {"name": "hard", "share": 0.2, "operations": ["*"], "min_digits": 2, "max_digits": 3},
]


def test_largest_remainder_sums_exactly():
    # 7 * [0.5, 0.3, 0.2] = [3.5, 2.1, 1.4]: floors 3 + 2 + 1 = 6, the one left goes to .5 -> [4, 2, 1]
    assert largest_remainder(7, [0.5, 0.3, 0.2]) == [4, 2, 1]
    # 10 / 3 each = 3.33: floors 9, the tie of remainders goes to the first
    assert largest_remainder(10, [1 / 3, 1 / 3, 1 / 3]) == [4, 3, 3]
    assert largest_remainder(0, [0.5, 0.5]) == [0, 0]


def test_a_mix_splits_sizes_by_share_and_tags_each_problem():
    train, evaluation = arithmetic_splits(seed=5, train_size=50, eval_size=7, mix=MIX)
    assert Counter(ex.columns["difficulty"] for ex in train) == {"easy": 25, "mid": 15, "hard": 10}
    assert Counter(ex.columns["difficulty"] for ex in evaluation) == {"easy": 4, "mid": 2, "hard": 1}
    for ex in train + evaluation:
        name = ex.columns["difficulty"]
        assert ex.id.split("-")[3] == name
        numbers = [int(x) for x in re.findall(r"\d+", ex.question)]
        if name == "easy":
            assert " + " in ex.question and all(n < 10 for n in numbers)
        if name == "hard":
            assert " * " in ex.question and all(10 <= n < 1000 for n in numbers)
    # The buckets are shuffled together, not laid end to end.
    assert [ex.columns["difficulty"] for ex in train[:10]] != ["easy"] * 10


def test_a_mix_is_deterministic_disjoint_and_its_eval_ignores_train_size():
    train, evaluation = arithmetic_splits(seed=5, train_size=60, eval_size=20, mix=MIX)
    assert (train, evaluation) == arithmetic_splits(seed=5, train_size=60, eval_size=20, mix=MIX)
    questions = [ex.question for ex in train + evaluation]
    assert len(set(questions)) == len(questions)  # within and across buckets and splits
    assert len({ex.id for ex in train + evaluation}) == 80
    _, evaluation_again = arithmetic_splits(seed=5, train_size=3, eval_size=20, mix=MIX)
    assert evaluation_again == evaluation
    _, other_seed = arithmetic_splits(seed=6, train_size=3, eval_size=20, mix=MIX)
    assert other_seed != evaluation


def test_no_mix_keeps_the_single_set_and_its_columns():
    single = arithmetic_splits(seed=5, train_size=20, eval_size=5)
    assert single == arithmetic_splits(seed=5, train_size=20, eval_size=5, mix=[])
    assert all("difficulty" not in ex.columns for ex in single[0] + single[1])
    assert single[1][0].id == "arithmetic-eval-5-0"


def test_the_source_passes_the_mix_through():
    evaluation = load_split("arithmetic", split="eval", seed=5, eval_size=7, mix=MIX)
    assert evaluation == arithmetic_splits(seed=5, train_size=0, eval_size=7, mix=MIX)[1]


def _mix(*buckets: str) -> str:
    return "data.arithmetic.mix=[" + ",".join(buckets) + "]"


def test_a_valid_mix_from_the_command_line_loads():
    cfg = compose_config(
        ["eval.every_steps=0", _mix("{name:easy,share:0.7}", "{name:hard,share:0.3,operations:[*]}")]
    )
    assert cfg.data.arithmetic.mix[1].operations == ["*"] and cfg.data.arithmetic.mix[0].operations is None


@pytest.mark.parametrize(
    "buckets,key",
    [
        (["{name:a,share:0.5}", "{name:b,share:0.4}"], "data.arithmetic.mix="),  # sums to 0.9
        (["{name:a,share:1.0}", "{name:b,share:0.0}"], "data.arithmetic.mix[1].share="),
        (["{name:a,share:0.5}", "{name:a,share:0.5}"], "data.arithmetic.mix[1].name='a'"),
        (["{name:'',share:1.0}"], "data.arithmetic.mix[0].name=''"),
        (["{name:'a/b',share:1.0}"], "data.arithmetic.mix[0].name='a/b'"),
        (["{name:a,share:1.0,num_operands:1}"], "data.arithmetic.mix[0].num_operands=1"),
        (["{name:a,share:1.0,min_digits:3,max_digits:2}"], "data.arithmetic.mix[0].max_digits=2"),
        (["{name:a,share:1.0,operations:['/']}"], "data.arithmetic.mix[0].operations=['/']"),
        (
            ["{name:a,share:1.0,word_problem_fraction:2.0}"],
            "data.arithmetic.mix[0].word_problem_fraction=2.0",
        ),
    ],
)
def test_a_bad_mix_names_its_key(buckets, key):
    with pytest.raises(ConfigError, match=re.escape(key)):
        compose_config(["eval.every_steps=0", _mix(*buckets)])  # converting the config checks it


def test_a_bucket_knob_left_out_is_checked_as_the_top_level_one():
    # min_digits 3 from the top level, max_digits 2 in the bucket: the bucket's key is the one named.
    top = ["eval.every_steps=0", "data.arithmetic.min_digits=3", "data.arithmetic.max_digits=4"]
    with pytest.raises(ConfigError, match=re.escape("data.arithmetic.mix[0].max_digits=2")):
        compose_config([*top, _mix("{name:a,share:1.0,max_digits:2}")])
