"""Pure scoring: (prompts, completions, answers) -> one reward per completion.

- `extract`: final answers out of completions, gold answers out of dataset fields.
- `functions`: the reward functions, one signature (see its docstring).
- `code`: the pure parts of the code-execution reward (running the code is `grpo_run.sandbox`).
- `names`: `RewardName`, the names a config writes.
- `call_cost`: a cost per tool call (env.call_cost) and its correctness margin.

The table from name to function and the safe caller the trainer uses are `grpo_run.scoring`.
"""

from grpo_run.rewards.extract import extract_answer, extract_gold
from grpo_run.rewards.functions import (
    RewardTimeoutError,
    format_reward,
    math_verifier,
    overlong_penalty,
    target_char_fraction,
)
from grpo_run.rewards.names import RewardName

__all__ = [
    "RewardName",
    "RewardTimeoutError",
    "extract_answer",
    "extract_gold",
    "format_reward",
    "math_verifier",
    "overlong_penalty",
    "target_char_fraction",
]
