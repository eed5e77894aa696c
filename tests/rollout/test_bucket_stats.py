"""train/reward_mean/<v> and train/tool_call_rate/<v> (eval.group_by): per bucket over the sampled
completions, every bucket's key added in the same order whatever was sampled (the ranks' one reduction),
a bucket nothing sampled left out of the step."""

import torch

from grpo_run import metrics as M
from grpo_run.data import Example, PromptSampler
from grpo_run.engine.single import SingleProcessEngine
from grpo_run.rollout.episodes import Episode, Episodes
from grpo_run.rollout.groups import record_bucket_stats


def _engine() -> SingleProcessEngine:
    return SingleProcessEngine(
        torch.nn.Linear(1, 1),
        lr=0.1,
        weight_decay=0.0,
        betas=(0.9, 0.999),
        lr_factor=lambda step: 1.0,
        max_grad_norm=1.0,
        device=torch.device("cpu"),
    )


def _example(i: int, bucket: str | None) -> Example:
    return Example(f"q{i}", "1", f"id{i}", {} if bucket is None else {"difficulty": bucket})


def _episodes(calls: list[int]) -> Episodes:
    return Episodes(None, [Episode(prompt=[1], tool_calls=c) for c in calls])  # type: ignore[arg-type]


BUCKETS = ("easy", "hard", "mid")


def test_per_bucket_rewards_and_tool_call_rates():
    stats = M.StepMetrics(torch.device("cpu"))
    examples = [_example(0, "easy"), _example(1, "hard"), _example(2, None)]  # G = 2 rows each
    totals = [1.0, 0.0, 0.5, None, 1.0, 1.0]  # hard's second completion unscorable
    calls = [0, 0, 2, 1, 0, 0]
    record_bucket_stats(stats, examples, 2, totals, _episodes(calls), group_by="difficulty", buckets=BUCKETS)
    out = stats.reduce(_engine())
    # easy: rewards [1, 0] -> 0.5, no call; hard: [0.5] (None out) -> 0.5, both episodes called; mid:
    # nothing sampled -> no keys; the example without the column counts in no bucket.
    assert out == {
        "train/reward_mean/easy": 0.5,
        "train/tool_call_rate/easy": 0.0,
        "train/reward_mean/hard": 0.5,
        "train/tool_call_rate/hard": 1.0,
    }


def test_every_bucket_key_is_added_in_one_order_whatever_a_rank_sampled():
    one, other = M.StepMetrics(torch.device("cpu")), M.StepMetrics(torch.device("cpu"))
    record_bucket_stats(one, [_example(0, "hard")], 1, [1.0], None, group_by="difficulty", buckets=BUCKETS)
    record_bucket_stats(other, [_example(0, "easy")], 1, [0.0], None, group_by="difficulty", buckets=BUCKETS)
    assert (
        list(one.parts()[0]) == list(other.parts()[0]) == [M.TRAIN_REWARD_MEAN_BY.format(b) for b in BUCKETS]
    )
    # Without an environment there is no tool-call key.
    assert one.reduce(_engine()) == {"train/reward_mean/hard": 1.0}


def test_the_buckets_come_from_the_training_examples_sorted():
    examples = [_example(0, "hard"), _example(1, "easy"), _example(2, None), _example(3, "hard")]
    sampler = PromptSampler(examples, seed=0, batch_size=2)
    assert sampler.column_values("difficulty") == ("easy", "hard")
    assert sampler.column_values("nothing") == ()
