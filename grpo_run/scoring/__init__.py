"""Calling the reward functions safely: one registry of rewards, the worker pool, the run's scorer.

- `registry`: `RewardEntry`, one record per reward (function, range, outcome kinds, isolation), and
  `BUILTIN_REWARDS`, the built-ins by name (`grpo_run.rewards`' functions and the sandbox's `code_exec`).
- `user`: a user's function or class by `_target_`, called as TRL calls a reward function.
- `model_reward`: a reward model or judge by `model: {path, kind}`, in a worker process of its own.
- `dispatch`: `score`, the safe caller the trainer uses: which entry runs where (in process, awaited
  together, in a pool), a failed batch called again one completion at a time.
- `pool`: `RewardPool`, the worker processes that run isolated calls under a wall-clock budget.
- `tally`: `RewardSpec` and `ScoreResult`: every call's outcome turned into values, counts, labels and the
  weighted totals.
- `run_scorer`: the run's reward functions bound to their config.

It sits above `grpo_run.rewards` (pure) and `grpo_run.sandbox` (which runs code), so neither imports it.
"""

from grpo_run.scoring.dispatch import UserInputs, score
from grpo_run.scoring.pool import RewardPool
from grpo_run.scoring.registry import BUILTIN_REWARDS, RewardEntry, RewardFn, builtin_entry, get_reward_fn
from grpo_run.scoring.tally import RewardSpec, ScoreResult

__all__ = [
    "BUILTIN_REWARDS",
    "RewardEntry",
    "RewardFn",
    "RewardPool",
    "RewardSpec",
    "ScoreResult",
    "UserInputs",
    "builtin_entry",
    "get_reward_fn",
    "score",
]
