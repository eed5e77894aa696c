"""Per-problem held-out results (grpo_run/evaluation/stats.py): rates with intervals, the paired change, the
per-problem files, and the eval.datasets config (prefixes, validation)."""

import json

import pytest
import torch
from hydra import compose, initialize_config_dir

from grpo_run import metrics as M
from grpo_run.algo.intervals import bootstrap_mean_interval, wilson_interval
from grpo_run.cli import CONF_DIR
from grpo_run.config import ConfigError, register_configs, to_config, validate
from grpo_run.data.splits import load_eval_split
from grpo_run.evaluation.report import report, results_table
from grpo_run.evaluation.stats import ProblemScores, paired_change, read_problems, summarize, write_problems

register_configs()


def config(overrides: list[str]):
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return to_config(compose(config_name="config", overrides=overrides))


def scores(greedy, sampled, boxed, ids=None) -> ProblemScores:
    ids = ids or [f"p{i}" for i in range(len(greedy))]
    k = len(sampled[0])
    flat = [s for row in sampled for s in row]
    return ProblemScores.from_rows(ids, greedy, flat, boxed, [5] * len(greedy), k=k)


def test_summarize_worked_numbers():
    # 4 problems, k = 2; problem p2's gold does not parse (None everywhere): it is left out of n.
    s = scores(
        greedy=[1.0, 0.0, None, 1.0],
        sampled=[[1.0, 0.0], [0.0, 0.0], [None, None], [1.0, 1.0]],
        boxed=[1.0, 0.0, 0.0, 1.0],
    )
    out = summarize(s)
    # accuracy: 2 of the 3 scorable greedy answers; its interval is Wilson on 2/3
    assert out[M.EVAL_ACCURACY] == pytest.approx(2 / 3)
    assert (out[M.EVAL_ACCURACY_CI_LOW], out[M.EVAL_ACCURACY_CI_HIGH]) == pytest.approx(wilson_interval(2, 3))
    # mean@k: (1 + 0 + 0 + 0 + 1 + 1) / 6 = 0.5; bootstrap over the per-problem means [0.5, 0, 1]
    assert out[M.EVAL_MEAN_AT_K] == 0.5
    expected = bootstrap_mean_interval(torch.tensor([0.5, 0.0, 1.0]), num_resamples=2000, seed=0).tolist()
    assert [out[M.EVAL_MEAN_AT_K_CI_LOW], out[M.EVAL_MEAN_AT_K_CI_HIGH]] == pytest.approx(expected)
    # pass@2 from 2 samples = "either correct": [1, 0, 1] -> 2/3
    assert out[M.EVAL_PASS_AT_K] == pytest.approx(2 / 3)
    assert out[M.EVAL_PASS_AT_K_CI_LOW] <= 2 / 3 <= out[M.EVAL_PASS_AT_K_CI_HIGH]
    # boxed counts every greedy answer, scorable or not: 2 of 4, Wilson on 2/4
    assert out[M.EVAL_BOXED_FRACTION] == 0.5
    assert out[M.EVAL_BOXED_FRACTION_CI_LOW] == pytest.approx(wilson_interval(2, 4)[0])
    assert out[M.EVAL_NUM_PROBLEMS] == 3 and out[M.EVAL_COMPLETION_LEN] == 5


def test_a_second_set_gets_its_own_prefix():
    s = scores([1.0, 0.0], [[1.0, 1.0], [0.0, 1.0]], [0.0, 0.0])
    plain, named = summarize(s), summarize(s, "gsm8k")
    assert set(named) == {k.replace("eval/", "eval/gsm8k/", 1) for k in plain}
    assert named["eval/gsm8k/accuracy"] == plain[M.EVAL_ACCURACY] == 0.5
    assert M.eval_key(M.EVAL_ACCURACY) == "eval/accuracy"  # the default set keeps the sweeper's key


def test_paired_change_pairs_problems_by_id():
    # before/after hold the same problems in different orders; p3 is only in `after` (not paired).
    before = scores(
        [1.0, 0.0, 0.0], [[1.0, 0.0], [0.0, 0.0], [0.0, 0.0]], [1.0, 1.0, 0.0], ids=["p0", "p1", "p2"]
    )
    after = scores(
        [1.0, 1.0, 0.0, 1.0],
        [[1.0, 1.0], [0.0, 0.0], [1.0, 0.0], [1.0, 1.0]],
        [1.0, 0.0, 1.0, 1.0],
        ids=["p2", "p1", "p0", "p3"],
    )
    change = paired_change(before, after)
    # greedy: p0 1 -> 0 (down), p1 0 -> 1 (up), p2 0 -> 1 (up)
    assert (change[M.EVAL_ACCURACY_FLIPS_UP], change[M.EVAL_ACCURACY_FLIPS_DOWN]) == (2, 1)
    # boxed: p0 1 -> 1, p1 1 -> 0 (down), p2 0 -> 1 (up)
    assert (change["eval/boxed_fraction_flips_up"], change["eval/boxed_fraction_flips_down"]) == (1, 1)
    assert change[M.EVAL_NUM_PROBLEMS] == 3
    # accuracy differences [-1, +1, +1]: mean 1/3, inside its bootstrap interval
    assert change[M.EVAL_ACCURACY_CI_LOW] <= 1 / 3 <= change[M.EVAL_ACCURACY_CI_HIGH]
    # mean@k differences: p0 0.5 -> 0.5, p1 0 -> 0, p2 0 -> 1: [0, 0, 1]; every resample lies in [0, 1]
    assert 0 <= change[M.EVAL_MEAN_AT_K_CI_LOW] <= change[M.EVAL_MEAN_AT_K_CI_HIGH] <= 1
    same = paired_change(before, before, "gsm8k")
    assert same["eval/gsm8k/accuracy_ci_low"] == same["eval/gsm8k/accuracy_ci_high"] == 0.0
    assert same["eval/gsm8k/accuracy_flips_up"] == same["eval/gsm8k/accuracy_flips_down"] == 0


def test_problem_files_round_trip(tmp_path):
    s = scores([1.0, None], [[1.0, 0.0], [None, None]], [1.0, 0.0])
    path = write_problems(tmp_path, 4, {"default": s, "math500": s})
    assert path == tmp_path / "eval_problems" / "step_4.json" and not path.with_suffix(".tmp").exists()
    assert read_problems(tmp_path, 4) == {"default": s, "math500": s}
    assert read_problems(tmp_path, 0) == {}  # an evaluation that left no file


def test_table_shows_intervals_and_flips(tmp_path):
    before = scores([0.0, 1.0], [[0.0, 1.0], [1.0, 1.0]], [1.0, 1.0])
    after = scores([1.0, 1.0], [[1.0, 1.0], [1.0, 1.0]], [1.0, 1.0])
    b, a = summarize(before), summarize(after)
    change = {M.EVAL_ACCURACY: a[M.EVAL_ACCURACY] - b[M.EVAL_ACCURACY], **paired_change(before, after)}
    columns = {"step 0": b, "step 2": a, "change": change}
    table = results_table("held-out", columns, k=2, n=2)
    from rich.console import Console

    console = Console(width=200, record=True)
    console.print(table)
    text = console.export_text()
    lo, hi = wilson_interval(1, 2)
    assert f"0.500 [{lo:.3f}, {hi:.3f}]" in text  # step 0's accuracy with its Wilson interval
    assert "0.500 [0.000, 1.000] (+1 -0)" in text  # the change: 1 problem gained, none lost
    report(str(tmp_path), "held-out", columns, n=2, k=2, datasets={"gsm8k": ({"step 0": {}}, 7)})
    saved = json.loads((tmp_path / "eval_summary.json").read_text())
    assert saved["change"][M.EVAL_ACCURACY_FLIPS_UP] == 1 and saved["datasets"]["gsm8k"]["num_prompts"] == 7


def test_eval_datasets_take_a_data_preset():
    hard = [
        "eval.datasets.hard.arithmetic.num_operands=3",
        "eval.datasets.hard.arithmetic.word_problem_fraction=0",
    ]
    cfg = config(["+data@eval.datasets.hard=arithmetic", *hard, "eval.datasets.hard.eval_size=20"])
    assert list(cfg.eval.datasets) == ["hard"] and cfg.eval.datasets["hard"].arithmetic.num_operands == 3
    examples = load_eval_split(cfg.eval.datasets["hard"])
    # three operands: two operators in every question ("What is 3 - 27 + 60?")
    assert len(examples) == 20 and all(x.question.count("+") + x.question.count("-") == 2 for x in examples)


@pytest.mark.parametrize(
    "overrides,key",
    [
        (
            ["+data@eval.datasets.mine=jsonl", "eval.datasets.mine.train_path=x.jsonl"],
            "eval.datasets.mine.eval_path",
        ),
        (["+data@eval.datasets.m=arithmetic", "eval.datasets.m.eval_size=0"], "eval.datasets.m.eval_size"),
        (
            ["+data@eval.datasets.m=arithmetic", "eval.datasets.m.prompt_template=x"],
            "eval.datasets.m.prompt_template",
        ),
    ],
)
def test_bad_eval_datasets_name_the_key(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        config(overrides)


def test_a_set_name_must_make_a_metric_prefix():
    # Hydra's override grammar refuses "a/b" already; a YAML config could still carry it.
    cfg = config([])
    cfg.eval.datasets["a/b"] = cfg.data
    with pytest.raises(ConfigError, match="eval.datasets='a/b'"):
        validate(cfg)


def test_console_line_shows_the_intervals():
    from grpo_run.tracking.sinks import compact_line

    out = summarize(scores([1.0, 0.0, 0.0], [[1.0, 0.0], [0.0, 0.0], [0.0, 0.0]], [0.0, 0.0, 0.0]))
    lo, hi = wilson_interval(1, 3)  # 1 of 3: [0.061, 0.792]
    assert f"eval acc 0.333 [{lo:.2f}, {hi:.2f}] mean@k 0.167 [" in compact_line(0, 2, out)
