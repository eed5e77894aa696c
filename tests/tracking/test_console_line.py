"""The console's step line carries what a TRL user watches: lr, grad_norm, entropy, tokens/s."""

from grpo_run import metrics as M
from grpo_run.tracking import compact_line


def test_step_line_shows_lr_grad_norm_entropy_and_tokens_per_s():
    values = {
        M.REWARD_MEAN: 0.5,
        M.REWARD_STD: 0.25,
        M.FRAC_REWARD_ZERO_STD: 0.0,
        M.CLIP_FRACTION: 0.0,
        M.LOSS: 0.0,
        M.GRAD_NORM: 0.4123,
        M.ENTROPY: 5.125,
        M.LR: 5e-3,
        M.COMPLETION_LEN_MEAN: 16.0,
        M.STEP_S: 0.2,
        M.TOKENS_PER_S: 2345.6,
    }
    line = compact_line(3, 40, values)
    assert line.startswith("step 3/40  reward 0.500±0.250")
    assert "grad_norm 0.412" in line and "entropy 5.125" in line and "lr 5.00e-03" in line
    assert "2346 tok/s" in line


def test_a_step_without_an_update_leaves_out_what_it_did_not_measure():
    # Every group's rewards were equal: the update was skipped, so no loss, gradient or entropy.
    values = {M.REWARD_MEAN: 1.0, M.REWARD_STD: 0.0, M.FRAC_REWARD_ZERO_STD: 1.0, M.LR: 5e-3, M.STEP_S: 0.1}
    line = compact_line(3, 40, values)
    assert "grad_norm" not in line and "entropy" not in line
    assert "lr 5.00e-03" in line


def test_the_step_line_shows_the_tool_call_rate_per_bucket():
    values = {M.REWARD_MEAN: 0.5, M.REWARD_STD: 0.1, M.STEP_S: 0.1}
    assert "tool calls" not in compact_line(3, 40, values)
    values |= {
        M.TRAIN_TOOL_CALL_RATE_BY.format("easy"): 0.125,
        M.TRAIN_TOOL_CALL_RATE_BY.format("hard"): 0.75,
    }
    values[M.TRAIN_REWARD_MEAN_BY.format("hard")] = 0.25  # per-bucket rewards stay in the logs only
    assert "tool calls easy 0.12 hard 0.75" in compact_line(3, 40, values)
