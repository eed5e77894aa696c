"""Procedural arithmetic problems with integer gold answers.

Two kinds of problem:

* expressions: ``"What is 37 + 48?"``, ``"What is 3 * 4 + 5?"`` (usual precedence: ``*`` before ``+``/``-``,
  then left to right);
* word problems from a few short templates: ``"Tom has 12 apples and buys 7 more. How many apples does
  Tom have now?"``. Word problems always use two operands (``num_operands`` applies to expressions only),
  operands of at least 2, and a subtraction story never takes away more than there is, so their answers
  are never negative.

Everything is drawn from ``random.Random(seed)``: the same arguments give the same problems, and the
first ``n`` problems of a larger request are the same as those of a smaller one.

A *mix* of difficulty buckets (:func:`arithmetic_splits` with ``mix``) draws each bucket from its own
stream with its own knobs, tags every problem with ``columns["difficulty"]`` (the bucket's name) and
shuffles the buckets together, so per-bucket metrics can tell easy problems from hard ones.
"""

import random
from collections.abc import Mapping, Sequence
from typing import Any

from grpo_run.config.checks.arithmetic import (
    Knobs,
    bucket_knobs,
    check_knobs,
    default_knobs,
)
from grpo_run.data.example import Example

# Consecutive rejected draws (negative or duplicate) before we conclude the problem space is exhausted.
_MAX_REJECTS = 10_000

_NAMES = ("Tom", "Ann", "Sara", "Ben", "Maya", "Leo", "Nina", "Omar", "Lucy", "Raj")
_ITEMS = ("apples", "marbles", "pencils", "stickers", "cookies", "books", "cards", "oranges", "shells")

# Templates per operation; {a} and {b} are the operands in that order, the answer is `a op b`.
_WORD_TEMPLATES: dict[str, tuple[str, ...]] = {
    "+": (
        "{name} has {a} {item} and buys {b} more. How many {item} does {name} have now?",
        "{name} picked {a} {item} in the morning and {b} {item} in the afternoon. "
        "How many {item} did {name} pick in total?",
        "There are {a} {item} in a basket. {name} puts {b} more {item} in the basket. "
        "How many {item} are in the basket now?",
    ),
    "-": (
        "{name} has {a} {item} and gives {b} of them to a friend. How many {item} does {name} have left?",
        "A shop had {a} {item}. It sold {b} of them. How many {item} does the shop have left?",
    ),
    "*": (
        "{name} has {a} bags with {b} {item} in each bag. How many {item} does {name} have in total?",
        "{name} buys {a} boxes of {item}. Each box holds {b} {item}. How many {item} does {name} buy?",
    ),
}


def evaluate(operands: Sequence[int], operators: Sequence[str]) -> int:
    """Value of ``operands[0] op[0] operands[1] ...`` with ``*`` binding tighter than ``+`` and ``-``."""
    total, sign, term = 0, 1, operands[0]
    for op, x in zip(operators, operands[1:]):
        if op == "*":
            term *= x
        else:
            total += sign * term
            sign, term = (1 if op == "+" else -1), x
    return total + sign * term


def generate_arithmetic(
    n: int,
    *,
    seed: int,
    num_operands: int = 2,
    min_digits: int = 1,
    max_digits: int = 2,
    operations: Sequence[str] = ("+", "-"),
    word_problem_fraction: float = 0.0,
    allow_negative: bool = False,
) -> list[Example]:
    """``n`` distinct arithmetic problems, deterministic for ``seed``.

    Args:
        n: how many problems.
        seed: seed of the ``random.Random`` that draws everything.
        num_operands: operands per expression (>= 2).
        min_digits, max_digits: each operand has a digit count drawn uniformly from this range
            (1 digit: 1..9, 2 digits: 10..99, ...).
        operations: the operators to draw from, a non-empty subset of ``("+", "-", "*")``.
        word_problem_fraction: probability that a problem is a word problem instead of an expression.
        allow_negative: allow expressions whose value is negative; otherwise they are redrawn.

    Returns:
        Examples with ids ``"arithmetic-{seed}-{i}"`` and the integer answer as a string.

    Raises:
        ValueError: an argument is out of range, or fewer than ``n`` distinct problems could be found
            (the digits/operations allow too few).
    """
    knobs = check_knobs(
        num_operands, min_digits, max_digits, operations, word_problem_fraction, allow_negative
    )
    return _generate(n, rng=random.Random(seed), knobs=knobs, id_prefix=f"arithmetic-{seed}", exclude=set())


def arithmetic_splits(
    *, seed: int, train_size: int, eval_size: int, mix: Sequence[Mapping[str, Any]] = (), **knobs
) -> tuple[list[Example], list[Example]]:
    """A train and an eval set of arithmetic problems with no question (or word-problem story) in common.

    The eval set depends only on ``seed``, ``eval_size`` and the knobs, so changing ``train_size`` never
    changes what is evaluated. The train set is drawn from its own stream and skips every eval problem.
    ``knobs`` are the keyword arguments of :func:`generate_arithmetic` (``num_operands``, ``min_digits``,
    ``max_digits``, ``operations``, ``word_problem_fraction``, ``allow_negative``).

    ``mix``: difficulty buckets, each a mapping with ``name``, ``share`` and any of the knobs in
    :data:`BUCKET_KNOBS` (missing or None: the top-level knob). Empty: one set from the knobs. See
    :func:`_mixed_splits`.

    Returns:
        ``(train, eval)``; ids are ``"arithmetic-train-{seed}-{i}"`` and ``"arithmetic-eval-{seed}-{i}"``
        (with a mix: ``"arithmetic-train-{seed}-{bucket}-{i}"``, ...).
    """
    if mix:
        return _mixed_splits(seed=seed, train_size=train_size, eval_size=eval_size, mix=mix, knobs=knobs)
    checked = check_knobs(**{**default_knobs(), **knobs})
    eval_keys: set[tuple] = set()
    # String seeds are hashed with SHA-512 by `random`, so they are stable across processes.
    eval_set = _generate(
        eval_size,
        rng=random.Random(f"{seed}/eval"),
        knobs=checked,
        id_prefix=f"arithmetic-eval-{seed}",
        exclude=set(),
        keys_out=eval_keys,
    )
    train_set = _generate(
        train_size,
        rng=random.Random(f"{seed}/train"),
        knobs=checked,
        id_prefix=f"arithmetic-train-{seed}",
        exclude=eval_keys,
    )
    return train_set, eval_set


def largest_remainder(total: int, shares: Sequence[float]) -> list[int]:
    """``total`` split by ``shares`` (summing to 1) into integers that sum to ``total`` exactly: each gets
    the floor of its quota, and the units left go to the largest fractional parts (ties: the earlier)."""
    quotas = [total * s for s in shares]
    counts = [int(q) for q in quotas]
    by_remainder = sorted(range(len(shares)), key=lambda i: (-(quotas[i] - counts[i]), i))
    for i in by_remainder[: total - sum(counts)]:
        counts[i] += 1
    return counts


def _mixed_splits(
    *, seed: int, train_size: int, eval_size: int, mix: Sequence[Mapping[str, Any]], knobs: Mapping[str, Any]
) -> tuple[list[Example], list[Example]]:
    """Both splits of a bucket mix. Sizes are split by share (:func:`largest_remainder`); every bucket is
    drawn from its own streams (``"{seed}/{name}/eval"``, ``".../train"``), so adding a bucket leaves the
    others' streams alone (their problems change only where the buckets' problem spaces overlap). Eval
    sets are drawn first, bucket after bucket, then train sets, each skipping every problem already drawn:
    no problem appears twice within or across buckets and splits, and the eval split never depends on
    ``train_size``. Each split is then shuffled by its own seeded stream so batches
    mix buckets."""
    checked = [(str(b["name"]), check_knobs(**bucket_knobs(b, knobs))) for b in mix]
    shares = [float(b["share"]) for b in mix]
    drawn: set[tuple] = set()
    splits = []
    for split, size in (("eval", eval_size), ("train", train_size)):
        examples: list[Example] = []
        for (name, bucket), count in zip(checked, largest_remainder(size, shares)):
            part = _generate(
                count,
                rng=random.Random(f"{seed}/{name}/{split}"),
                knobs=bucket,
                id_prefix=f"arithmetic-{split}-{seed}-{name}",
                exclude=set(),
                keys_out=drawn,  # skips and records every problem drawn so far, in any bucket or split
                difficulty=name,
            )
            examples += part
        random.Random(f"{seed}/mix/{split}").shuffle(examples)
        splits.append(examples)
    evaluation, train = splits
    return train, evaluation


def _generate(
    n: int,
    *,
    rng: random.Random,
    knobs: Knobs,
    id_prefix: str,
    exclude: set[tuple],
    keys_out: set[tuple] | None = None,
    difficulty: str | None = None,
) -> list[Example]:
    if n < 0:
        raise ValueError(f"the number of problems must be >= 0, got {n}")
    seen: set[tuple] = set() if keys_out is None else keys_out
    examples: list[Example] = []
    rejects = 0
    while len(examples) < n:
        drawn = _draw(rng, knobs)
        if drawn is None or drawn[0] in seen or drawn[0] in exclude:
            rejects += 1
            if rejects > _MAX_REJECTS:
                bucket = "" if difficulty is None else f" in bucket {difficulty!r}"
                raise ValueError(
                    f"could only find {len(examples)} distinct arithmetic problems{bucket} of the {n} asked "
                    "for (train and eval together never repeat a problem); lower data.train_size / "
                    "data.eval_size or "
                    f"widen the digits ({knobs.min_digits}..{knobs.max_digits}), operations "
                    f"{knobs.operations} or num_operands ({knobs.num_operands})"
                )
            continue
        rejects = 0
        key, question, answer = drawn
        seen.add(key)
        columns = {"question": question, "answer": str(answer)}  # a generated record's two columns
        if difficulty is not None:
            columns["difficulty"] = difficulty
        examples.append(Example(question, str(answer), f"{id_prefix}-{len(examples)}", columns))
    return examples


def _operand(rng: random.Random, knobs: Knobs, low: int = 1) -> int:
    digits = rng.randint(knobs.min_digits, knobs.max_digits)
    return rng.randint(max(low, 10 ** (digits - 1)), 10**digits - 1)


def _draw(rng: random.Random, knobs: Knobs) -> tuple[tuple, str, int] | None:
    """One candidate ``(dedup key, question, answer)``, or None when it breaks the sign rule."""
    if knobs.word_problem_fraction > 0 and rng.random() < knobs.word_problem_fraction:
        return _draw_word_problem(rng, knobs)
    operands = [_operand(rng, knobs) for _ in range(knobs.num_operands)]
    operators = [rng.choice(knobs.operations) for _ in range(knobs.num_operands - 1)]
    value = evaluate(operands, operators)
    if value < 0 and not knobs.allow_negative:
        return None
    expression = " ".join([str(operands[0])] + [f"{op} {x}" for op, x in zip(operators, operands[1:])])
    return ("expression", expression), f"What is {expression}?", value


def _draw_word_problem(rng: random.Random, knobs: Knobs) -> tuple[tuple, str, int] | None:
    op = rng.choice(knobs.operations)
    template_index = rng.randrange(len(_WORD_TEMPLATES[op]))
    # Operands >= 2 keep the plurals grammatical ("1 apples").
    a, b = _operand(rng, knobs, low=2), _operand(rng, knobs, low=2)
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    if op == "-" and b > a:
        return None  # a story cannot give away more than it has, whatever allow_negative says
    question = _WORD_TEMPLATES[op][template_index].format(name=name, item=item, a=a, b=b)
    # The key ignores name and item: the same story with other nouns counts as a duplicate.
    return ("word", op, template_index, a, b), question, evaluate([a, b], [op])
