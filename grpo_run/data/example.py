"""The one record type every prompt source produces, and the one error type they raise."""

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from grpo_run.config.checks.base import ConfigError


@dataclass(frozen=True)
class Example:
    """One prompt with its gold answer.

    Attributes:
        question: the problem text shown to the model (before any chat template); for a conversational
            record, the content of its last user turn (for logs and length estimates).
        answer: the gold *final* answer, ready for verification (e.g. ``"72"``, ``"\\frac{14}{3}"``),
            never a worked solution; ``""`` when the source has no answer column (a user's reward reads
            what it needs from ``columns``).
        id: a stable identifier, unique within its split (file stem and line, a record id, or a
            generator index).
        columns: every column of the source record under its own name, as the dataset gave it (JSON-like
            values); user reward functions receive them as keyword arguments, as in TRL.
        messages: a conversational record's prompt as role/content turns (TRL's conversational format);
            None for a plain question, which the data config's template turns into a chat.
    """

    question: str
    answer: str
    id: str
    columns: Mapping[str, Any] = field(default_factory=dict, hash=False)
    messages: tuple[Mapping[str, str], ...] | None = field(default=None, hash=False)


class DataError(ValueError):
    """A data source could not be loaded. The message names the file (and line) or dataset id."""


class DataKeyError(DataError, ConfigError):
    """A data key names a column or split the dataset does not have, or a column whose values cannot be
    what the key reads: a config error (exit 2), found while the data loads, before any model does. The
    message names every such key of the dataset, the columns or splits there are and the likely key."""
