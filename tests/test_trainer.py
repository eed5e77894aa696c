"""How the algorithm variants reach the loop: dynamic-sampling selection, the truncation mask and the
loss denominators, adaptive β, the entropy bonus's gradient, the presets and the variant config checks.

The variants' pure math (advantages, aggregations, clips, KL estimators, GSPO) has its worked numbers in
test_algo_advantages.py and test_algo_losses.py; these tests cover the wiring around it.
"""

import pytest
import torch
from hydra import compose, initialize_config_dir

from grpo_run.algo import AdvantageMode, Aggregation, ImportanceLevel, aggregate, zero_std_groups
from grpo_run.cli import CONF_DIR
from grpo_run.config import Config, ConfigError, register_configs, to_config
from grpo_run.config.schema import KLControlConfig, KLControlKind
from grpo_run.models.tiny import build_model, build_tokenizer
from grpo_run.native.forward import NativeSettings, native_completion_logprobs
from grpo_run.rollout.filtering import (
    concat_rollouts,
    group_rows,
    informative_groups,
    loss_mask,
    take_rows,
)
from grpo_run.rollout.generate import Rollout
from grpo_run.rollout.groups import ScoredGroups as StepBatch
from grpo_run.rollout.groups import concat_groups as concat_batches
from grpo_run.rollout.groups import select_groups
from grpo_run.scoring.tally import ScoreResult
from grpo_run.trainer import control_beta
from grpo_run.update import loss_normalizer

register_configs()
PAD = 0


def compose_config(overrides: list[str]) -> Config:
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return to_config(compose(config_name="config", overrides=overrides))


def make_rollout(groups: int, group_size: int, prompt_len: int, completion_len: int, start: int) -> Rollout:
    """Rows with recognisable ids: completion row r holds start + r everywhere (its mask is all ones)."""
    n = groups * group_size
    rows = torch.arange(start, start + n).unsqueeze(-1)  # [N, 1]
    return Rollout(
        prompt_ids=rows.repeat(1, prompt_len),  # [N, P]
        prompt_mask=torch.ones(n, prompt_len, dtype=torch.long),
        completion_ids=rows.repeat(1, completion_len),  # [N, T]
        completion_mask=torch.ones(n, completion_len, dtype=torch.long),
        truncated=torch.zeros(n, dtype=torch.bool),
    )


def scored_batch(
    rewards: list[list[float]], *, prompt_len: int, completion_len: int, start: int
) -> StepBatch:
    r = torch.tensor(rewards)  # [B, G]
    b, g = r.shape
    rollout = make_rollout(b, g, prompt_len, completion_len, start)
    flat = r.flatten().tolist()
    scores = ScoreResult(total=list(flat), per_function={"fn": list(flat)})
    examples = [f"prompt {start}-{i}" for i in range(b)]
    return StepBatch(examples, rollout, r, torch.ones_like(r, dtype=torch.bool), scores)


# --- dynamic sampling (DAPO) ---------------------------------------------------------------------


def test_informative_groups_keeps_the_first_needed_non_zero_std_groups():
    zero_std = torch.tensor([True, False, True, False, False])
    assert informative_groups(zero_std, 2) == [1, 3]
    assert informative_groups(zero_std, 10) == [1, 3, 4]  # fewer than needed: all there are
    assert informative_groups(zero_std, 0) == []
    assert informative_groups(torch.tensor([True, True]), 2) == []  # nothing informative


def test_group_rows():
    # G = 3: group 0 -> rows 0, 1, 2; group 2 -> rows 6, 7, 8.
    assert group_rows([0, 2], 3) == [0, 1, 2, 6, 7, 8]


def test_two_rounds_of_selection_leave_no_zero_std_group():
    """B = 3. Round 1 (G = 2): [1,1] and [0,0] have equal rewards and are dropped, [0,1] and [1,0] are
    kept; one group is still missing, so round 2 runs: [0,0] dropped, [1,0] kept, surplus [0,1] unused."""
    need = 3
    round1 = scored_batch([[1, 1], [0, 1], [0, 0], [1, 0]], prompt_len=3, completion_len=5, start=0)
    round2 = scored_batch([[0, 0], [1, 0], [1, 1], [0, 1]], prompt_len=6, completion_len=2, start=100)

    kept = []
    for batch in (round1, round2):
        have = sum(k.rewards.size(0) for k in kept)
        groups = informative_groups(zero_std_groups(batch.rewards), need - have)
        if groups:
            kept.append(select_groups(batch, groups, 2))
    assert [k.examples for k in kept] == [["prompt 0-1", "prompt 0-3"], ["prompt 100-1"]]

    merged = concat_batches(kept, PAD)
    assert merged.rewards.tolist() == [[0, 1], [1, 0], [1, 0]]
    assert not zero_std_groups(merged.rewards).any()  # no zero-std group reaches the update
    # Rows follow their groups: round 1 group 1 = rows 2, 3; group 3 = rows 6, 7; round 2 group 1 = 102, 103.
    assert merged.rollout.completion_ids[:, 0].tolist() == [2, 3, 6, 7, 102, 103]
    assert merged.scores.total == [0, 1, 1, 0, 1, 0]
    assert merged.scores.per_function["fn"] == merged.scores.total


def test_concat_rollouts_pads_prompts_left_and_completions_right():
    a = make_rollout(1, 2, prompt_len=2, completion_len=3, start=5)
    b = make_rollout(1, 2, prompt_len=4, completion_len=1, start=9)
    b.truncated = torch.tensor([True, False])
    out = concat_rollouts([a, b], PAD)
    assert out.prompt_ids.tolist() == [[0, 0, 5, 5], [0, 0, 6, 6], [9, 9, 9, 9], [10, 10, 10, 10]]
    assert out.prompt_mask.tolist() == [[0, 0, 1, 1], [0, 0, 1, 1], [1, 1, 1, 1], [1, 1, 1, 1]]
    assert out.completion_ids.tolist() == [[5, 5, 5], [6, 6, 6], [9, 0, 0], [10, 0, 0]]
    assert out.completion_mask.tolist() == [[1, 1, 1], [1, 1, 1], [1, 0, 0], [1, 0, 0]]
    assert out.truncated.tolist() == [False, False, True, False]
    assert take_rows(out, [3, 0]).completion_ids[:, 0].tolist() == [10, 5]


# --- overlong filtering (mask_truncated) and the loss denominators --------------------------------


def test_loss_mask_excludes_truncated_completions():
    rollout = make_rollout(1, 3, prompt_len=1, completion_len=3, start=0)
    rollout.completion_mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]])
    rollout.truncated = torch.tensor([False, True, False])
    assert loss_mask(rollout, mask_truncated=True).tolist() == [[1, 1, 0], [0, 0, 0], [1, 0, 0]]
    assert loss_mask(rollout, mask_truncated=False).tolist() == rollout.completion_mask.float().tolist()


def test_masked_completions_leave_the_denominator():
    """ℓ = [[1, 2, ·], [5, 5, 5], [4, ·, ·]] with row 1 truncated and masked:
    per_token: (1 + 2 + 4) / 3 tokens = 7/3; per_response: ((1 + 2)/2 + 4/1) / 2 completions = 2.75;
    constant_length L = 4: ((1 + 2)/4 + 4/4) / 2 = 0.875. The masked row neither adds nor counts."""
    losses = torch.tensor([[1.0, 2.0, 9.0], [5.0, 5.0, 5.0], [4.0, 9.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0], [1.0, 0.0, 0.0]])
    expected = {
        Aggregation.PER_TOKEN: 7 / 3,
        Aggregation.PER_RESPONSE: 2.75,
        Aggregation.CONSTANT_LENGTH: 0.875,
    }
    for agg, value in expected.items():
        normalizer = loss_normalizer(mask, agg)
        assert normalizer.item() == (3 if agg is Aggregation.PER_TOKEN else 2)
        got = aggregate(losses, mask, agg, normalizer=normalizer, constant_length=4)
        assert got.item() == pytest.approx(value)


def test_without_masking_every_completion_counts():
    mask = torch.tensor([[1.0, 0.0], [1.0, 1.0]])  # every completion has at least its first token
    assert loss_normalizer(mask, Aggregation.PER_RESPONSE).item() == 2
    assert loss_normalizer(mask, Aggregation.PER_TOKEN).item() == 3


# --- adaptive β (PPO's controller) ---------------------------------------------------------------


def controlled(kind: KLControlKind, beta: float, metrics: dict[str, float]) -> float:
    # B·G = 8 completions per step
    return control_beta(beta, metrics, KLControlConfig(kind=kind, target=0.1, horizon=80), completions=8)


@pytest.mark.parametrize(
    "kl,expected",
    [
        # error = kl/target - 1, clipped to ±0.2; β *= 1 + error · 8/80.
        (0.2, 0.04 * (1 + 0.2 * 0.1)),  # KL above target: error 1 -> 0.2, β grows to 0.0408
        (0.05, 0.04 * (1 - 0.2 * 0.1)),  # below: error -0.5 -> -0.2, β shrinks to 0.0392
        (0.11, 0.04 * (1 + 0.1 * 0.1)),  # slightly above: error 0.1 unclipped, β 0.0404
        (0.1, 0.04),  # on target: unchanged
    ],
)
def test_adaptive_beta_follows_the_step_kl(kl, expected):
    assert controlled(KLControlKind.ADAPTIVE, 0.04, {"train/kl": kl}) == pytest.approx(expected)


def test_adaptive_beta_compounds_over_steps_and_ignores_steps_without_kl():
    beta = 0.04
    for kl in (0.5, 0.5, 0.0):
        beta = controlled(KLControlKind.ADAPTIVE, beta, {"train/kl": kl})
    assert beta == pytest.approx(0.04 * 1.02 * 1.02 * 0.98)
    # an update skipped by dynamic sampling: no KL
    assert controlled(KLControlKind.ADAPTIVE, beta, {"train/reward_mean": 0.3}) == beta


def test_fixed_beta_never_moves():
    assert controlled(KLControlKind.FIXED, 0.04, {"train/kl": 5.0}) == 0.04


# --- the entropy bonus carries gradient ----------------------------------------------------------


def test_entropy_carries_gradient_only_when_asked():
    torch.manual_seed(0)
    tokenizer = build_tokenizer()
    model = build_model(tokenizer)
    prompt = torch.randint(3, 100, (2, 4))  # [n, P]
    completion = torch.randint(3, 100, (2, 3))  # [n, T]
    kw = {"settings": NativeSettings(1.0, 4), "with_entropy": True}
    _, metric = native_completion_logprobs(model, prompt, torch.ones_like(prompt), completion, **kw)
    _, bonus = native_completion_logprobs(
        model, prompt, torch.ones_like(prompt), completion, entropy_grad=True, **kw
    )
    assert not metric.requires_grad and bonus.requires_grad
    torch.testing.assert_close(metric, bonus.detach())
    bonus.sum().backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and any(g.abs().sum() > 0 for g in grads)


# --- presets and config checks -------------------------------------------------------------------


def test_experiment_presets_set_their_deltas():
    base = compose_config([])
    grpo = compose_config(["experiment=grpo"]).grpo
    assert grpo.beta == 0.04 and grpo.advantage_mode is AdvantageMode.NORMALIZED
    dr = compose_config(["experiment=dr_grpo", "generation.max_new_tokens=64"]).grpo
    assert dr.advantage_mode is AdvantageMode.CENTERED
    assert dr.aggregation is Aggregation.CONSTANT_LENGTH and dr.constant_length == 64
    dapo = compose_config(["experiment=dapo"]).grpo
    assert dapo.aggregation is Aggregation.PER_TOKEN and dapo.filter_zero_std
    assert (dapo.epsilon, dapo.epsilon_high) == (0.2, 0.28)
    assert compose_config(["experiment=rloo"]).grpo.advantage_mode is AdvantageMode.RLOO
    gspo = compose_config(["experiment=gspo"]).grpo
    assert gspo.importance_level is ImportanceLevel.SEQUENCE and gspo.epsilon_high == 4e-4
    # A preset changes nothing else: dr_grpo keeps every other grpo field of the defaults.
    changed = {"advantage_mode", "aggregation", "constant_length"}
    for name in base.grpo.__dataclass_fields__:
        if name not in changed:
            assert getattr(dr, name) == getattr(base.grpo, name), name
    # The command line still wins over a preset.
    assert (
        compose_config(["experiment=dr_grpo", "advantage_mode=rloo"]).grpo.advantage_mode
        is AdvantageMode.RLOO
    )


def test_variant_groups_compose():
    cfg = compose_config(["kl_control=adaptive", "grpo.beta=0.04", "reward=overlong_penalty"])
    assert cfg.kl_control.kind is KLControlKind.ADAPTIVE
    overlong = {fn.name: fn.kwargs for fn in cfg.reward.functions}["overlong_penalty"]
    assert overlong["max_new_tokens"] == cfg.generation.max_new_tokens
    assert (
        compose_config(["advantage_mode=normalized_batch"]).grpo.advantage_mode
        is AdvantageMode.NORMALIZED_BATCH
    )
    # GSPO's sequence ratio with a single pass is allowed (the ratio is 1; the gradient is GSPO's).
    assert (
        compose_config(["grpo.importance_level=sequence", "grpo.num_iterations=1"]).grpo.num_iterations == 1
    )


@pytest.mark.parametrize(
    "overrides,key",
    [
        (["grpo.clip_ratio_c=1.0"], "grpo.clip_ratio_c"),
        (["grpo.constant_length=0"], "grpo.constant_length"),
        (["grpo.entropy_coef=-0.01"], "grpo.entropy_coef"),
        (["grpo.max_resample_rounds=0"], "grpo.max_resample_rounds"),
        (["kl_control=adaptive", "grpo.beta=0.04", "kl_control.target=0"], "kl_control.target"),
        (["kl_control=adaptive", "grpo.beta=0.04", "kl_control.horizon=0"], "kl_control.horizon"),
        (["kl_control=adaptive"], "grpo.beta"),  # β = 0 would stay 0 forever
        (
            ["reward=overlong_penalty", "generation.max_new_tokens=4"],
            "reward.functions[1].kwargs.buffer_length",
        ),
        (
            ["advantage_mode=normalized_batch", "distributed=zero2", "distributed.nproc_per_node=2"],
            "grpo.advantage_mode",
        ),
    ],
)
def test_bad_variant_values_name_the_key(overrides, key):
    with pytest.raises(ConfigError, match=key.replace("[", r"\[").replace("]", r"\]")):
        compose_config(overrides)
