"""Every algorithm variant through the real `grpo-run` on the tiny model, with its effect checked where a
metric can show it. Several orthogonal options share one run to keep the number of CLI starts low.

The tiny model almost never samples EOS (1 token in 512), so with a short generation.max_new_tokens
every completion runs to the limit: lengths are all equal, which makes several effects exact.
"""

import math

import pytest

from grpo_run import metrics as M
from tests.builders import run_here
from tests.helpers import FAST, read_metrics, run_cli

STEP_COMPLETIONS = 8  # FAST: 2 prompts x 4 completions


def assert_finite(row: dict, keys) -> None:
    for key in keys:
        assert key in row, key
        assert isinstance(row[key], float) and math.isfinite(row[key]), (key, row[key])


def test_adaptive_beta_k2_entropy_bonus_constant_length_batch_std(tmp_path):
    """kl_control=adaptive, kl_estimator=k2, entropy_coef, aggregation=constant_length and
    advantage_mode=normalized_batch in one 3-step run."""
    args = [
        *FAST,
        "trainer.max_steps=3",
        "trainer.lr=1e-2",
        "grpo.beta=0.04",
        "kl_control=adaptive",
        "kl_control.target=1e-6",
        "kl_control.horizon=80",
        "grpo.kl_estimator=k2",
        "grpo.entropy_coef=0.01",
        "aggregation=constant_length",
        "advantage_mode=normalized_batch",
        "logger=console",
    ]
    rows = read_metrics(run_here(args, tmp_path / "run"))  # in this process: the knobs are under test
    assert [r["step"] for r in rows] == [1, 2, 3]
    for row in rows:
        assert_finite(row, [*M.ALWAYS, M.KL])
        assert row[M.TRUNCATED_FRACTION] == 1.0  # every completion is L = max_new_tokens = 8 long
        # Each completion's token sum / L with every length = L is a token mean; group-mean-centred
        # advantages sum to 0 over the step, so the loss is β·mean KL − coef·mean entropy exactly.
        expected = row[M.BETA] * row[M.KL] - 0.01 * row[M.ENTROPY]
        assert row[M.LOSS] == pytest.approx(expected, abs=1e-6)
    # Step 1: π_θ = π_ref, KL = 0 < target: β shrinks by 0.2 · 8/80 = 2%. Step 2 measured KL > 0 far
    # above the 1e-6 target: β grows by 2%. β is logged as the value the step used.
    assert rows[0][M.KL] == 0.0 and rows[1][M.KL] > 1e-5 and rows[0][M.LOSS] < 0  # the entropy bonus
    assert [r[M.BETA] for r in rows] == pytest.approx([0.04, 0.04 * 0.98, 0.04 * 0.98 * 1.02])


def test_experiment_sweep_compares_the_named_recipes(tmp_path):
    """`grpo-run -m experiment=grpo,dr_grpo,dapo,rloo,gspo`: one job per recipe, each trains.

    μ = 2 and the dual clip make the second pass clip; lr 1e-2 makes the policy move."""
    sweep = tmp_path / "sweep"
    recipes = ["grpo", "dr_grpo", "dapo", "rloo", "gspo"]
    base = [*FAST, "trainer.lr=1e-2", "grpo.num_iterations=2", "grpo.clip_ratio_c=3"]
    run_cli(["-m", *base, f"experiment={','.join(recipes)}", f"hydra.sweep.dir={sweep}"], tmp_path)
    rows = {}
    for job, recipe in enumerate(recipes):
        assert f"experiment={recipe}" in (sweep / str(job) / ".hydra" / "overrides.yaml").read_text()
        rows[recipe] = read_metrics(sweep / str(job))
        assert [r["step"] for r in rows[recipe]] == [1, 2]
        for row in rows[recipe]:
            assert_finite(row, M.ALWAYS)
            assert row[M.TRUNCATED_FRACTION] == 1.0
    assert all(M.KL in r and r[M.BETA] == 0.04 for r in rows["grpo"])  # GRPO's KL term
    assert all(M.KL not in r for r in rows["dapo"])  # DAPO: no KL
    assert all(r[M.GENERATION_ROUNDS] >= 1 for r in rows["dapo"])
    # GSPO: one ratio per completion, so a completion's 8 tokens are clipped together: over the 2 passes
    # of 8 equally long completions the clipped share is a whole number of 1/16ths (token level: 1/128ths).
    for row in rows["gspo"]:
        assert row[M.CLIP_FRACTION] > 0
        assert (row[M.CLIP_FRACTION] * 2 * STEP_COMPLETIONS) == pytest.approx(
            round(row[M.CLIP_FRACTION] * 2 * STEP_COMPLETIONS)
        )
    # RLOO's advantage is G/(G−1) = 4/3 of the centred one (seed 000's identity r − μ = (G−1)/G ·
    # (r − baseline_{−i})); Adam's steps ignore the gradient's scale (up to its ε), so both runs stay in
    # step and every gradient norm is 4/3 of Dr. GRPO's (all lengths = L: constant_length = per_response).
    for rloo, dr in zip(rows["rloo"], rows["dr_grpo"], strict=True):
        assert rloo[M.GRAD_NORM] == pytest.approx(4 / 3 * dr[M.GRAD_NORM], rel=1e-2)


def test_dynamic_sampling_keeps_zero_std_groups_out_of_the_update(tmp_path):
    """Two-token completions, G = 2, reward = share of 'a': many groups score 0 twice (zero std).

    Also k1 KL, whose per-token values may be negative."""
    args = [
        *FAST,
        "trainer.max_steps=3",
        "trainer.prompts_per_step=4",
        "grpo.group_size=2",
        "generation.max_new_tokens=2",
        "grpo.filter_zero_std=true",
        "grpo.max_resample_rounds=4",
        "grpo.beta=0.04",
        "grpo.kl_estimator=k1",
        "logger=console",
    ]
    rows = read_metrics(run_here(args, tmp_path / "run"))
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert sum(r[M.DROPPED_GROUPS] for r in rows) > 0  # the reward was constant for some prompts
    for row in rows:
        assert 1 <= row[M.GENERATION_ROUNDS] <= 4
        if M.LOSS in row:  # an update happened: none of its groups had equal rewards
            assert_finite(row, [*M.ALWAYS, M.KL])
            assert row[M.FRAC_REWARD_ZERO_STD] == 0.0
        else:  # nothing informative in 4 rounds: skipped, and every logged group was zero-std
            assert row[M.GENERATION_ROUNDS] == 4 and row[M.FRAC_REWARD_ZERO_STD] == 1.0


def test_overlong_penalty_and_mask_truncated(tmp_path):
    """reward=overlong_penalty (math_verifier + DAPO's soft punishment, buffer 8 = max_new_tokens)
    with grpo.mask_truncated=true."""
    args = [*FAST, "reward=overlong_penalty", "grpo.mask_truncated=true", "logger=console"]
    rows = read_metrics(run_here(args, tmp_path / "run"))
    assert [r["step"] for r in rows] == [1, 2]  # every step is logged, trained or not
    for row in rows:
        # Safe length 8 − 8 = 0, so a completion of L tokens scores −L/8: the mean is −mean length/8.
        penalty = row[M.REWARD_FN_MEAN.format("overlong_penalty")]
        assert penalty == pytest.approx(-row[M.COMPLETION_LEN_MEAN] / 8)
        assert M.REWARD_FN_MEAN.format("math_verifier") in row
        assert row[M.MASKED_TRUNCATED] == pytest.approx(row[M.TRUNCATED_FRACTION] * STEP_COMPLETIONS)
        assert row[M.MASKED_TRUNCATED] > 0
        # Every completion truncated and masked: nothing left to learn from, so the update is skipped
        # (an optimizer step on a zero gradient would still move the weights by Adam's momentum).
        assert (M.LOSS in row) == (row[M.TRUNCATED_FRACTION] < 1.0)


POLICY_LOSSES = ["clip", "cispo", "sapo", "dppo_tv", "dppo_kl"]


def test_every_policy_loss_trains_with_every_new_knob_and_lora(tmp_path):
    """`grpo-run -m grpo.policy_loss=clip,cispo,sapo,dppo_tv,dppo_kl` with μ = 2, LoRA, the token-level
    loss, the top-50% entropy tokens, the off-policy mask, the bias-corrected KL, adaptive entropy and
    GDPO over two reward functions all on: one job per surrogate, each trains and logs the knobs' shares."""
    sweep = tmp_path / "sweep"
    base = [
        *FAST,
        "trainer.lr=1e-2",
        "grpo.num_iterations=2",
        "lora=default",
        "aggregation=per_token",
        "grpo.beta=0.04",
        "grpo.kl_bias_correction=true",
        "grpo.top_entropy_quantile=0.5",
        "grpo.off_policy_mask_threshold=0.0",
        "grpo.entropy_control=adaptive",
        "grpo.entropy_target=100",  # above any entropy: the coefficient grows by delta every step
        "reward.functions=[{name:target_char_fraction,weight:1.0,kwargs:{target:a}},{name:format,weight:0.5}]",
        "reward.aggregation=normalize_then_sum",
    ]
    run_cli(
        ["-m", *base, f"grpo.policy_loss={','.join(POLICY_LOSSES)}", f"hydra.sweep.dir={sweep}"], tmp_path
    )
    for job, loss in enumerate(POLICY_LOSSES):
        assert f"grpo.policy_loss={loss}" in (sweep / str(job) / ".hydra" / "overrides.yaml").read_text()
        rows = read_metrics(sweep / str(job))
        assert [r["step"] for r in rows] == [1, 2]
        for row in rows:
            keys = [*M.ALWAYS, M.KL, M.ENTROPY_KEPT_FRACTION, M.OFF_POLICY_MASKED_FRACTION, M.ENTROPY_COEF]
            assert_finite(row, keys)
            assert row[M.ENTROPY_KEPT_FRACTION] == pytest.approx(0.5, abs=0.1)
            assert (M.TRUST_REGION_MASKED_FRACTION in row) == loss.startswith("dppo")
        # step 1 applies no bonus (nothing measured yet); step 2 the coefficient grown by one delta
        assert [r[M.ENTROPY_COEF] for r in rows] == pytest.approx([0.0, 0.005])


def test_sequence_level_policy_losses_train(tmp_path):
    """GSPO's sequence-level ratio where the surrogate allows it (clip, cispo, sapo), with μ = 2."""
    sweep = tmp_path / "sweep"
    base = [*FAST, "trainer.lr=1e-2", "grpo.num_iterations=2", "grpo.importance_level=sequence"]
    losses = ["cispo", "sapo"]
    run_cli(["-m", *base, f"grpo.policy_loss={','.join(losses)}", f"hydra.sweep.dir={sweep}"], tmp_path)
    for job in range(len(losses)):
        rows = read_metrics(sweep / str(job))
        assert [r["step"] for r in rows] == [1, 2]
        for row in rows:
            assert_finite(row, M.ALWAYS)
