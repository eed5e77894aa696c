"""Held-out evaluation (grpo_run/evaluation/held_out.py, grpo_run/evaluation/report.py): scoring, schedule, checkpoint lookup, real data golds."""

import json
import math

import pytest
import torch
from hydra import compose, initialize_config_dir

from grpo_run import metrics as M
from grpo_run.backend import generation_engine
from grpo_run.cli import CONF_DIR
from grpo_run.config import register_configs, to_config
from grpo_run.config.schema import ModelKind
from grpo_run.data import Example
from grpo_run.data.splits import load_data
from grpo_run.evaluation.held_out import (
    EvalInputs,
    correctness,
    evaluate,
    is_due,
)
from grpo_run.evaluation.report import report
from grpo_run.models.loading import load_model, load_tokenizer
from grpo_run.rewards import format_reward
from grpo_run.rewards.extract import is_unevaluated_arithmetic
from grpo_run.run_context import checkpoint_model
from grpo_run.scoring import RewardPool
from tests.conftest import SHARED_DATA

register_configs()


def config(overrides: list[str]):
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return to_config(compose(config_name="config", overrides=overrides))


@pytest.fixture(scope="module")
def pool():
    with RewardPool() as p:
        yield p


def inputs_for(cfg, examples, pool, tokenizer=None, engine=None):
    return EvalInputs(cfg, tokenizer, examples, pool, torch.device("cpu"), engine)


def test_correctness_scores_only_the_extracted_final_answer(pool):
    cfg = config(["model=tiny"])
    examples = [Example("What is 43 + 5?", "48", "a"), Example("What is 7 - 2?", "5", "b")]
    texts = [
        "What is 43 + 5? 43 + 5",  # restates the question: math-verify alone would evaluate it to 48
        r"43 + 5 = 48, so \boxed{48}",
        "7 - 2 = 5",  # the last-number fallback (data.fallback_last_number: true)
        r"\boxed{}",  # an empty box is no answer
    ]
    assert correctness(inputs_for(cfg, examples, pool), examples, texts, k=2) == [0.0, 1.0, 1.0, 0.0]


def test_boxing_the_question_earns_nothing(pool):
    """Measured: within 20 steps SmolLM2 learned to answer `\\boxed{73 - 4}`, which math-verify evaluates."""
    cfg = config(["model=tiny"])
    examples = [Example("What is 73 - 4?", "69", "a")]
    texts = [
        "To solve \\boxed{73 - 4}, we subtract: 73 - 4 = 4",  # the question in a box: 0
        "\\boxed{69 = 73 - 4}",  # the value is the side after the last `=`: still undone, 0
        "\\boxed{(70 + 3) - 4}",
        "73 - 4 = \\boxed{69}",
        "\\boxed{73 - 4 = 69}",  # a worked equation ending in the value is an answer
    ]
    assert correctness(inputs_for(cfg, examples, pool), examples, texts, k=5) == [0.0, 0.0, 0.0, 1.0, 1.0]
    # Nor does the format bonus pay for a box around the question.
    assert format_reward([], texts, []) == [0.0, 0.0, 0.0, 1.0, 1.0]


@pytest.mark.parametrize(
    "answer,undone",
    [
        ("43 + 5", True),
        ("6 \\times 7", True),
        ("$43+5$", True),
        ("-7", False),
        ("1,234", False),
        ("3/4", False),  # a fraction is a value
        ("\\frac{14}{3}", False),
        ("x + 1", False),  # algebra, not arithmetic
        ("3 - 2i", False),
        ("2\\sqrt{3}", False),
    ],
)
def test_unevaluated_arithmetic(answer, undone):
    assert is_unevaluated_arithmetic(answer) is undone


def test_fallback_off_needs_a_box(pool):
    cfg = config(["model=tiny", "data.fallback_last_number=false"])
    examples = [Example("What is 7 - 2?", "5", "b")]
    assert correctness(inputs_for(cfg, examples, pool), examples, ["7 - 2 = 5", r"\boxed{5}"], k=2) == [
        0.0,
        1.0,
    ]


def test_eval_schedule():
    e = config(["eval.every_steps=24"]).eval
    # Step 0 (before training), every 24 steps, and the last step even off the grid.
    assert [s for s in range(0, 51) if is_due(e, s, 50)] == [0, 24, 48, 50]
    assert not any(is_due(config(["eval.every_steps=0"]).eval, s, 50) for s in range(51))


def test_checkpoint_resolves_a_run_dir_to_its_final_folder(tmp_path):
    (tmp_path / "final").mkdir()
    (tmp_path / "final" / "config.json").write_text("{}")
    model = checkpoint_model(config([f"eval.checkpoint={tmp_path}"]))
    assert model.kind is ModelKind.PRETRAINED and model.path == str(tmp_path / "final")
    model = checkpoint_model(config([f"eval.checkpoint={tmp_path / 'final'}"]))
    assert model.path == str(tmp_path / "final")
    assert checkpoint_model(config([])).kind is ModelKind.SMOLLM2  # no checkpoint: the configured model


def test_tiny_model_evaluation_is_repeatable(pool):
    overrides = ["model=tiny", "trainer.device=cpu", "eval.num_prompts=6", "eval.samples_per_prompt=3"]
    cfg = config([*overrides, "eval.max_new_tokens=6", "eval.batch_size=4", "eval.temperature=1.0"])
    _, examples = load_data(cfg.data)
    tokenizer = load_tokenizer(cfg.model)
    model = load_model(cfg.model, torch.device("cpu"), trainable=True)
    inputs = inputs_for(cfg, examples, pool, tokenizer, generation_engine(cfg, model, tokenizer))
    first, second = evaluate(inputs), evaluate(inputs)
    assert model.training  # evaluate puts the model back the way it found it
    for key in (M.EVAL_ACCURACY, M.EVAL_MEAN_AT_K, M.EVAL_BOXED_FRACTION, M.EVAL_COMPLETION_LEN):
        assert math.isfinite(first[key]) and first[key] == second[key], key
    assert 1 <= first[M.EVAL_COMPLETION_LEN] <= 6


def test_report_writes_the_summary(tmp_path):
    columns = {"step 0": {M.EVAL_ACCURACY: 0.2}, "step 9": {M.EVAL_ACCURACY: 0.5}}
    report(str(tmp_path), "held-out", columns, n=200, k=4)
    saved = json.loads((tmp_path / "eval_summary.json").read_text())
    assert saved["num_prompts"] == 200 and saved["step 9"][M.EVAL_ACCURACY] == 0.5


# Every gold of the held-out splits parses: a completion that boxes the gold itself scores 1.
def _gold_fixture(tmp_path, name: str) -> list[str]:
    if name == "gsm8k":
        rows = [
            {"question": f"q{i}", "answer": f"work\n#### {gold}"} for i, gold in enumerate(["1,234", "72"])
        ]
    else:
        rows = [
            {"problem": "p0", "answer": "\\frac{14}{3}", "unique_id": "a"},
            {"problem": "p1", "answer": "\\left( 3, \\frac{\\pi}{2} \\right)", "unique_id": "b"},
        ]
    path = tmp_path / f"{name}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return [f"data.eval_path={path}"] + (["data.train_path=" + str(path)] if name == "gsm8k" else [])


@pytest.mark.parametrize("name", ["gsm8k", "math500"])
def test_every_held_out_gold_verifies_against_itself(tmp_path, pool, name):
    real = (SHARED_DATA / f"{name}_test.jsonl").is_file()
    # math500 carves its training split out of the one file: the two-record fixture keeps one for eval.
    size = "data.eval_size=1" if name == "math500" and not real else "data.eval_size=200"
    # The real files through the presets' local override (GRPO_RUN_DATA's key), else a small fixture.
    local = [f"data.local_dir={SHARED_DATA}"] if real else _gold_fixture(tmp_path, name)
    overrides = [f"data={name}", size, *local]
    cfg = config(overrides)
    _, examples = load_data(cfg.data)
    assert len(examples) == (200 if real else 1 if name == "math500" else 2)
    if name == "gsm8k":
        assert all("," not in x.answer for x in examples)  # thousands commas removed
    texts = [f"The answer is \\boxed{{{x.answer}}}." for x in examples]
    scores = correctness(inputs_for(cfg, examples, pool), examples, texts, k=1)
    assert [x.id for x, s in zip(examples, scores) if s != 1.0] == []
