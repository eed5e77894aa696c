"""Calling the reward functions safely: the name -> function table, the worker pool, the run's scorer.

- `registry`: `RewardName` -> function table (`grpo_run.rewards`' functions and the sandbox's `code_exec`),
  each function's range and labels, `get_reward_fn`.
- `pool`: `score`, the safe caller the trainer uses (errors, timeouts, a process pool).
- `run_scorer`: the run's reward functions bound to their config.

It sits above `grpo_run.rewards` (pure) and `grpo_run.sandbox` (which runs code), so neither imports it.
"""

from grpo_run.scoring.pool import RewardLengthError, RewardPool, RewardSpec, ScoreResult, score
from grpo_run.scoring.registry import ISOLATED_REWARDS, REWARD_FUNCTIONS, RewardFn, get_reward_fn

__all__ = [
    "ISOLATED_REWARDS",
    "REWARD_FUNCTIONS",
    "RewardFn",
    "RewardLengthError",
    "RewardPool",
    "RewardSpec",
    "ScoreResult",
    "get_reward_fn",
    "score",
]
