"""Pure scoring: (prompts, completions, answers) -> one reward per completion; a registry by name.

- `extract`: final answers out of completions, gold answers out of dataset fields.
- `functions`: the reward functions, one signature (see its docstring).
- `registry`: `RewardName` -> function table, `get_reward_fn`.
- `scoring`: `score`, the safe caller the trainer uses (errors, timeouts, a process pool).
"""

from grpo_run.rewards.extract import extract_answer, extract_gold
from grpo_run.rewards.functions import (
    RewardTimeoutError,
    format_reward,
    math_verifier,
    overlong_penalty,
    target_char_fraction,
)
from grpo_run.rewards.registry import ISOLATED_REWARDS, REWARD_FUNCTIONS, RewardFn, RewardName, get_reward_fn
from grpo_run.rewards.scoring import RewardLengthError, RewardPool, RewardSpec, ScoreResult, score

__all__ = [
    "ISOLATED_REWARDS",
    "REWARD_FUNCTIONS",
    "RewardFn",
    "RewardLengthError",
    "RewardName",
    "RewardPool",
    "RewardSpec",
    "RewardTimeoutError",
    "ScoreResult",
    "extract_answer",
    "extract_gold",
    "format_reward",
    "get_reward_fn",
    "math_verifier",
    "overlong_penalty",
    "score",
    "target_char_fraction",
]
