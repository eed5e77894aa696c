"""The names of every swappable piece of the math, shared by config and algo.

Each Enum is a `str` so that a YAML value, a CLI override and the Enum compare equal.
"""

from enum import Enum


class AdvantageMode(str, Enum):
    NORMALIZED = "normalized"  # (r - mean) / (std + eps), the GRPO paper
    CENTERED = "centered"  # r - mean (Dr. GRPO)
    RAW = "raw"  # r


class StdCorrection(str, Enum):
    POPULATION = "population"  # divide squared deviations by G
    SAMPLE = "sample"  # divide by G - 1 (Bessel), as TRL does


class Aggregation(str, Enum):
    PER_RESPONSE = "per_response"  # mean over completions of the per-completion token mean
    PER_TOKEN = "per_token"  # sum over all tokens of the step / token count of the step (DAPO)
