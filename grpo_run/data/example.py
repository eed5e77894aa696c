"""The one record type every prompt source produces, and the one error type they raise."""

from dataclasses import dataclass


@dataclass(frozen=True)
class Example:
    """One prompt with its gold answer.

    Attributes:
        question: the problem text shown to the model (before any chat template).
        answer: the gold *final* answer, ready for verification (e.g. ``"72"``, ``"\\frac{14}{3}"``),
            never a worked solution.
        id: a stable identifier, unique within its split (file stem and line, a record id, or a
            generator index).
    """

    question: str
    answer: str
    id: str


class DataError(ValueError):
    """A data source could not be loaded. The message names the file (and line) or dataset id."""
