"""The reward functions' names, as a config writes them (`reward.functions[i].name`).

Names only, so that config validation can check a name without importing the functions; the table from
name to function is `grpo_run/scoring/registry.py`.
"""

from enum import StrEnum


class RewardName(StrEnum):
    MATH_VERIFIER = "math_verifier"  # final answer equals the gold under math-verify
    FORMAT = "format"  # a non-empty \boxed{} is present
    OVERLONG_PENALTY = "overlong_penalty"  # DAPO soft overlong punishment (needs completion_lengths)
    TARGET_CHAR_FRACTION = "target_char_fraction"  # share of one character; for learning tests
    CODE_EXEC = "code_exec"  # the completion's code passes the problem's tests, run in a sandbox
    REASONING_GYM = "reasoning_gym"  # a reasoning-gym task's own checker (data=reasoning_gym)
