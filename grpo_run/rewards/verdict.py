"""A generative judge's verdict as a reward: its template, its options, and reading its answer.

Pure: the judge's forward passes are `grpo_run/scoring/model_reward.py`; here only the text it is shown
and the numbers read from what it gives back.

- `yes_prob`: the judge's probability of its "yes" answer after the prompt, normalised against its "no"
  answer: P(yes) / (P(yes) + P(no)), from the two answers' log-probs; with `no_text: null`, P(yes) itself.
- `number`: the first number of the judge's greedy reply; a reply without one is unscorable (None), a
  failure of the judge that is not the completion's to pay for.
"""

from __future__ import annotations

import math
import string
from enum import StrEnum

from grpo_run.rewards.extract import first_number


class Verdict(StrEnum):
    YES_PROB = "yes_prob"
    NUMBER = "number"


# What the template may name: the question as the dataset gave it, the gold answer ("" when the dataset
# has none) and the completion being judged.
TEMPLATE_FIELDS = ("question", "answer", "completion")

DEFAULT_TEMPLATE = (
    "Decide whether a student's answer to a question is correct.\n"
    "Question: {question}\n"
    "Reference answer: {answer}\n"
    "Student's answer: {completion}\n"
    "Is the student's final answer correct? Reply with Yes or No."
)

# The judge's kwargs and their defaults.
JUDGE_OPTIONS = {
    "template": DEFAULT_TEMPLATE,
    "verdict": Verdict.YES_PROB.value,
    "yes_text": "Yes",  # the answer whose probability is the reward (yes_prob)
    "no_text": "No",  # the answer it is normalised against; null: P(yes) unnormalised
    "max_new_tokens": 8,  # the reply's length (number)
}


def template_fields(template: str) -> list[str]:
    """The field names a template uses, in order; ValueError when it does not parse as a format string."""
    return [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]


def render(template: str, question: str, answer: str, completion: str) -> str:
    return template.format(question=question, answer=answer, completion=completion)


def yes_probability(logp_yes: float, logp_no: float | None) -> float:
    """P(yes) / (P(yes) + P(no)) from the two answers' log-probs (a logistic of their difference, which
    stays finite however small both are); P(yes) when `logp_no` is None."""
    if logp_no is None:
        return math.exp(logp_yes)
    return 1.0 / (1.0 + math.exp(logp_no - logp_yes))


def number_verdict(reply: str) -> float | None:
    """The first number of the judge's reply, or None when it wrote none. A score written as a ratio
    (`8/10`) is its numerator, on the template's own scale."""
    found = first_number(reply)
    return None if found is None else float(found.partition("/")[0])
