"""The in-flight alarms (grpo_run/tracking/alarms.py) fed step metrics by hand."""

import math

from grpo_run import metrics as M
from grpo_run.config.schema import AlertsConfig
from grpo_run.tracking.alarms import Alarms


def alarms(**cfg):
    said: list[tuple[str, str]] = []
    a = Alarms(
        AlertsConfig(**cfg),
        max_new_tokens=32,
        completions_per_round=8,
        max_consecutive_nonfinite=3,
        announce=lambda title, text: said.append((title, text)),
    )
    return a, said


def healthy(**over) -> dict[str, float]:
    m = {
        M.TRUNCATED_FRACTION: 0.2,
        M.FRAC_REWARD_ZERO_STD: 0.5,
        M.FRAC_ALL_WRONG: 0.25,
        M.FRAC_ALL_CORRECT: 0.25,
    }
    m |= {M.REWARD_ERRORS: 0.0, M.REWARD_TIMEOUTS: 0.0, M.GENERATION_ROUNDS: 1.0, M.GRAD_NORM: 0.5}
    return m | over


def test_truncation_needs_three_steps_in_a_row_and_is_said_once():
    a, said = alarms()
    cut = healthy(**{M.TRUNCATED_FRACTION: 0.95})
    # 2 cut steps, a normal one (streak reset), then 4 cut: active from the third of those on.
    seq = [cut, cut, healthy(), cut, cut, cut, cut]
    active = [a.observe(i + 1, m)[M.ALERT_TRUNCATED] for i, m in enumerate(seq)]
    assert active == [0, 0, 0, 0, 0, 1, 1]
    assert len(said) == 1 and "step 6" in said[0][0] and "max_new_tokens=32" in said[0][1]
    # Exactly at the threshold counts (>= 0.9).
    b, _ = alarms(truncated_steps=1)
    assert b.observe(1, healthy(**{M.TRUNCATED_FRACTION: 0.9}))[M.ALERT_TRUNCATED] == 1


def test_zero_std_splits_all_wrong_all_correct_and_mixed():
    for wrong, correct, key in [
        (1.0, 0.0, M.ALERT_ALL_WRONG),
        (0.0, 1.0, M.ALERT_ALL_CORRECT),
        (0.5, 0.5, M.ALERT_NO_SIGNAL),
    ]:
        a, said = alarms()
        m = healthy(**{M.FRAC_REWARD_ZERO_STD: 1.0, M.FRAC_ALL_WRONG: wrong, M.FRAC_ALL_CORRECT: correct})
        out = [a.observe(s, m) for s in range(1, 6)]
        assert [o[key] for o in out] == [0, 0, 0, 0, 1], key
        assert sum(o[k] for o in out for k in M.ALERT_KEYS) == 1  # only that one, only at step 5
        assert len(said) == 1 and key in said[0][0]
    a, _ = alarms()
    # 0.99 of the groups zero-std is still a signal.
    assert all(
        a.observe(s, healthy(**{M.FRAC_REWARD_ZERO_STD: 0.99}))[M.ALERT_NO_SIGNAL] == 0 for s in range(9)
    )


def test_reward_failures_above_a_tenth_of_the_completions():
    a, said = alarms()
    # 8 completions: 1 failure is 12.5% > 10%; with 2 generation rounds (16 completions) 6.25% is not.
    assert a.observe(1, healthy(**{M.REWARD_ERRORS: 1.0}))[M.ALERT_REWARD_FAILURES] == 1
    assert (
        a.observe(2, healthy(**{M.REWARD_TIMEOUTS: 1.0, M.GENERATION_ROUNDS: 2.0}))[M.ALERT_REWARD_FAILURES]
        == 0
    )
    assert (
        a.observe(3, healthy(**{M.REWARD_ERRORS: 0.5, M.REWARD_TIMEOUTS: 0.5}))[M.ALERT_REWARD_FAILURES] == 1
    )
    assert len(said) == 1 and "12%" in said[0][1]


def test_empty_completions_fire_on_the_collapsed_self_distillation_runs_lengths():
    # train/completion_len_mean of distill=self, seed 0, steps 25-32 (docs/performance.md): under 2 tokens
    # from step 29 (1.44, 1.52, 1.78), so the third of those, step 31, is the first the alarm holds at.
    lengths = [11.94, 6.34, 3.44, 2.56, 1.44, 1.52, 1.78, 1.0]
    a, said = alarms()
    out = [a.observe(s, healthy(**{M.COMPLETION_LEN_MEAN: x})) for s, x in enumerate(lengths, start=25)]
    assert [o[M.ALERT_EMPTY] for o in out] == [0, 0, 0, 0, 0, 0, 1, 1]
    assert len(said) == 1 and "step 31" in said[0][0] and "distill.coef" in said[0][1]
    # A one-letter answer and its end-of-turn token (2.0 tokens) is not empty; a streak resets.
    b, _ = alarms()
    seq = [2.0, 1.5, 1.5, 2.0, 1.5, 1.5]
    assert all(
        b.observe(s, healthy(**{M.COMPLETION_LEN_MEAN: x}))[M.ALERT_EMPTY] == 0 for s, x in enumerate(seq)
    )
    # generation.max_new_tokens=1 allows nothing longer: never said.
    c = Alarms(
        AlertsConfig(), max_new_tokens=1, completions_per_round=8, max_consecutive_nonfinite=3, announce=None
    )
    assert all(c.observe(s, healthy(**{M.COMPLETION_LEN_MEAN: 1.0}))[M.ALERT_EMPTY] == 0 for s in range(5))


def test_the_empty_streak_survives_a_resume():
    a, _ = alarms()
    for s in (1, 2):
        a.observe(s, healthy(**{M.COMPLETION_LEN_MEAN: 1.0}))
    b, _ = alarms()
    b.load_state_dict(a.state_dict())
    assert b.observe(3, healthy(**{M.COMPLETION_LEN_MEAN: 1.0}))[M.ALERT_EMPTY] == 1


def test_kl_only_when_logged_and_above_the_threshold():
    a, said = alarms(kl_max=0.1)
    assert a.observe(1, healthy())[M.ALERT_KL] == 0  # beta = 0: no train/kl
    assert a.observe(2, healthy(**{M.KL: 0.1}))[M.ALERT_KL] == 0
    assert a.observe(3, healthy(**{M.KL: 0.25}))[M.ALERT_KL] == 1 and "0.25" in said[0][1]


def test_nonfinite_warns_before_the_run_stops():
    a, said = alarms(nonfinite_steps=2)
    nan = healthy(**{M.GRAD_NORM: math.nan, M.SKIPPED_STEPS: 1.0})
    out = [a.observe(s, m)[M.ALERT_NONFINITE] for s, m in enumerate([nan, healthy(), nan, nan], 1)]
    assert out == [0, 0, 0, 1]
    assert "trainer.max_consecutive_nonfinite=3" in said[0][1]


def test_silent_on_healthy_steps_and_off_when_disabled():
    a, said = alarms()
    assert all(v == 0 for s in range(10) for v in a.observe(s, healthy()).values())
    assert not said
    off, said = alarms(enabled=False)
    assert off.observe(1, healthy(**{M.REWARD_ERRORS: 8.0})) == {} and not said


def test_weights_unchanged_fires_on_an_applied_update_with_a_gradient_that_moved_nothing():
    a, said = alarms()
    moved = healthy(**{M.UPDATE_NORM: 1e-30, M.SKIPPED_STEPS: 0.0})
    frozen = healthy(**{M.UPDATE_NORM: 0.0, M.SKIPPED_STEPS: 0.0})
    out = [a.observe(s, m) for s, m in enumerate([moved, frozen, frozen], start=1)]
    assert [o[M.ALERT_WEIGHTS_UNCHANGED] for o in out] == [0, 1, 1]  # any movement at all is movement
    assert len(said) == 1 and "step 2" in said[0][0] and "train/grad_norm=0.5" in said[0][1]
    b, said = alarms()
    quiet = [
        healthy(**{M.UPDATE_NORM: 0.0, M.GRAD_NORM: 0.0}),  # no gradient: nothing to move by
        healthy(**{M.UPDATE_NORM: 0.0, M.GRAD_NORM: math.inf, M.SKIPPED_STEPS: 1.0}),  # skipped: nonfinite's
        healthy(**{M.UPDATE_NORM: 0.0, M.GRAD_NORM: math.nan}),
        {k: v for k, v in healthy().items() if k != M.GRAD_NORM},  # no update this step
    ]
    assert all(b.observe(s, m)[M.ALERT_WEIGHTS_UNCHANGED] == 0 for s, m in enumerate(quiet, start=1))
    assert not any("weights_unchanged" in title for title, _ in said)
