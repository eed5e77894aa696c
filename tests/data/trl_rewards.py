"""A reward written for TRL's GRPOTrainer, reading its dataset's own `solution` column (tests/data)."""


def mentions_solution(prompts, completions, solution, **kwargs):
    """1.0 where the completion holds the record's solution text, else 0.0."""
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [float(s in t) for s, t in zip(solution, texts, strict=True)]
