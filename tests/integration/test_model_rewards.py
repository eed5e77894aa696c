"""A reward model in a whole run on the tiny model, beside math_verifier by weight; and
scripts/train_reward_model.py end to end on the tiny model, its folder then scoring as a reward entry."""

import importlib.util
import json
import math

import pytest

from grpo_run import metrics as M
from grpo_run import trainer
from grpo_run.config.schema import RewardModelKind
from grpo_run.models.frozen import FrozenSpec
from grpo_run.scoring.model_reward import ModelReward
from tests.builders import QUIET, config, tiny_classifier
from tests.helpers import FAST, REPO, read_metrics


def test_a_reward_model_and_math_verifier_score_a_step_by_weight(tmp_path):
    rm = tiny_classifier(tmp_path / "rm")
    rewards = (
        f"reward.functions=[{{name: rm, model: {{path: {rm}, batch_size: 4}}, weight: 0.5}},"
        " {name: math_verifier, weight: 1.0}]"
    )
    run_dir = tmp_path / "run"
    trainer.train(config([*FAST, *QUIET, rewards, "trainer.max_steps=1"], run_dir))
    (row,) = read_metrics(run_dir)
    rm_mean, mv_mean = row["train/rewards/rm_mean"], row["train/rewards/math_verifier_mean"]
    assert math.isfinite(rm_mean) and rm_mean != 0
    assert (row[M.REWARD_ERRORS], row[M.REWARD_TIMEOUTS]) == (0, 0)
    # every completion scored by both: the mean of the weighted sum is the weighted sum of the means
    assert row[M.REWARD_MEAN] == pytest.approx(0.5 * rm_mean + 1.0 * mv_mean, rel=1e-5)
    assert M.FRAC_ALL_CORRECT not in row  # a classifier's logit has no bounds


def test_train_reward_model_script_saves_a_folder_that_scores_as_a_reward(tmp_path):
    spec = importlib.util.spec_from_file_location(
        "train_reward_model", REPO / "scripts" / "train_reward_model.py"
    )
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = tmp_path / "rm"
    overrides = ["model=tiny", "trainer.device=cpu", "generation.max_new_tokens=8"]
    result = script.main(["--out", str(out), "--prompts", "10", "--samples", "2", "--steps", "5", *overrides])
    assert result == json.loads((out / "rm_report.json").read_text())
    assert result["fit_completions"] + result["held_out_completions"] == 20  # arithmetic golds all parse
    assert result["held_out_completions"] == 4  # 2 of the 10 problems held out, 2 samples each
    assert result["majority_accuracy"] >= 0.5
    # right scores [2, 0], wrong [1, 0, -1]: 2 beats all three; 0 ties 0 (a half) and beats -1 -> 4.5 / 6
    assert script.ranking_auc([2.0, 0.0], [1.0, 0.0, -1.0]) == 0.75
    assert script.ranking_auc([1.0], []) is None  # no wrong answer: nothing to rank
    rm = ModelReward(FrozenSpec(str(out)), RewardModelKind.CLASSIFIER)
    scores = rm(["What is 2 + 3?", "What is 2 + 3?"], ["5", "7"], ["5", "5"])
    assert all(math.isfinite(s) for s in scores) and scores[0] != scores[1]
