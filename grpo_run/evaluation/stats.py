"""Per-problem held-out results and what is computed from them: the eval/* rates with 95% intervals,
and the paired before/after change with its interval and flip counts (docs/evaluation.md).

The evaluation (grpo_run/evaluation/held_out.py) generates and scores; this module only aggregates. Each
evaluation's per-problem results are kept in the run dir (`eval_problems/step_<N>.json`), so the final
summary of a resumed run still pairs the same problems with its step-0 evaluation.
"""

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from grpo_run import metrics as M
from grpo_run.algo.intervals import (
    bootstrap_mean_interval,
    flip_counts,
    paired_difference,
    pass_at_k,
    wilson_interval,
)

# The run's own held-out split (data.*) in the per-problem files; its metrics keep the plain eval/ keys.
DEFAULT_SET = "default"
PROBLEMS_DIR = "eval_problems"
# A fixed bootstrap seed: two reports of the same per-problem results give the same interval.
BOOTSTRAP_SEED = 0
BOOTSTRAP_RESAMPLES = 2000


@dataclass
class ProblemScores:
    """One evaluation of one held-out set, problem by problem (None: the gold cannot be parsed, or the
    reward could not score the completion)."""

    ids: list[str]
    greedy: list[float | None]  # greedy answer correct (1/0)
    sampled: list[list[float | None]]  # the k sampled answers of each problem
    boxed: list[float]  # greedy answer holds a non-empty \boxed{}
    lengths: list[int]  # greedy completion length, tokens
    # False: the set has no gold answers, so no correctness (greedy all None, sampled empty).
    graded: bool = True
    # eval.reward's weighted total of each greedy completion; None: no eval.reward entries.
    reward: list[float | None] | None = None
    rewards: dict[str, list[float | None]] = field(default_factory=dict)  # per function, the same rows
    reward_errors: int = 0  # (function, completion) cells that raised or timed out (scored 0)
    # eval.group_by: each problem's value of that column (its bucket); None: no grouping.
    groups: list[str] | None = None
    # Each problem's greedy episode's tool calls; None: no environment.
    tool_calls: list[int] | None = None

    @classmethod
    def from_rows(
        cls, ids, greedy, sampled_flat, boxed, lengths, *, k: int, graded: bool = True
    ) -> "ProblemScores":
        """From the evaluation's flat lists (sampled row i·k + j: completion j of problem i)."""
        sampled = [list(sampled_flat[i * k : (i + 1) * k]) for i in range(len(ids))]
        return cls(list(ids), list(greedy), sampled, list(boxed), list(lengths), graded=graded)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "ProblemScores":
        return cls(**data)


def _wilson_keys(key: str, values: list[float]) -> dict[str, float]:
    low, high = wilson_interval(int(sum(values)), len(values))
    return {key + M.CI_LOW: low, key + M.CI_HIGH: high}


def _bootstrap_keys(key: str, per_problem: list[float]) -> dict[str, float]:
    low, high = bootstrap_mean_interval(
        torch.tensor(per_problem, dtype=torch.float64), num_resamples=BOOTSTRAP_RESAMPLES, seed=BOOTSTRAP_SEED
    ).tolist()
    return {key + M.CI_LOW: low, key + M.CI_HIGH: high}


def summarize(scores: ProblemScores, dataset: str | None = None) -> dict[str, float]:
    """eval/* of one held-out set (keys prefixed by `M.eval_key(..., dataset)`), each rate with its interval.

    accuracy (greedy pass@1) and boxed_fraction: Wilson intervals (a binomial count). mean@k and pass@k
    average k samples per problem: a percentile bootstrap over problems (the samples of one problem are
    correlated, so a binomial over all n·k samples would be too narrow). A set without gold answers has
    none of the correctness keys. eval.reward's mean: see `_reward_keys`.
    """
    out: dict[str, float] = _correctness_keys(scores) if scores.graded else {}
    out[M.EVAL_BOXED_FRACTION] = sum(scores.boxed) / len(scores.boxed) if scores.boxed else math.nan
    out.update(_wilson_keys(M.EVAL_BOXED_FRACTION, scores.boxed))
    out[M.EVAL_COMPLETION_LEN] = sum(scores.lengths) / len(scores.lengths) if scores.lengths else math.nan
    out.update(_reward_keys(scores))
    if scores.tool_calls is not None:
        out.update(_calls_keys(M.EVAL_CALLS_PER_EPISODE, scores.tool_calls))
    if scores.groups is not None:
        out.update(_bucket_keys(scores))
    return {M.eval_key(key, dataset): value for key, value in out.items()}


def _calls_keys(key: str, calls: list[int]) -> dict[str, float]:
    """Mean tool calls per greedy episode with a percentile bootstrap interval over problems (a count per
    problem, no 0/1 rate)."""
    per_problem = [float(c) for c in calls]
    mean = sum(per_problem) / len(per_problem) if per_problem else math.nan
    return {key: mean, **_bootstrap_keys(key, per_problem)}


def _bucket_keys(scores: ProblemScores) -> dict[str, float]:
    """Per value of eval.group_by (a difficulty bucket), in sorted order: pass@1 with its Wilson interval
    and the bucket's problem count; with an environment, the share of greedy episodes that called a tool
    (Wilson) and their mean calls (bootstrap)."""
    assert scores.groups is not None
    out: dict[str, float] = {}
    for value in sorted(set(scores.groups)):
        rows = [i for i, g in enumerate(scores.groups) if g == value]
        if scores.graded:
            greedy = [g for g in (scores.greedy[i] for i in rows) if g is not None]
            key = M.EVAL_PASS_AT_1_BY.format(value)
            out[key] = sum(greedy) / len(greedy) if greedy else math.nan
            out.update(_wilson_keys(key, greedy))
            out[M.EVAL_NUM_PROBLEMS_BY.format(value)] = float(len(greedy))
        else:
            out[M.EVAL_NUM_PROBLEMS_BY.format(value)] = float(len(rows))
        if scores.tool_calls is not None:
            calls = [scores.tool_calls[i] for i in rows]
            key = M.EVAL_TOOL_CALL_RATE_BY.format(value)
            called = [float(c > 0) for c in calls]
            out[key] = sum(called) / len(called)
            out.update(_wilson_keys(key, called))
            out.update(_calls_keys(M.EVAL_CALLS_PER_EPISODE_BY.format(value), calls))
    return out


def _correctness_keys(scores: ProblemScores) -> dict[str, float]:
    """pass@1 (accuracy), mean@k and pass@k with their intervals, and how many problems' gold parses."""
    greedy = [g for g in scores.greedy if g is not None]
    sampled = [[s for s in row if s is not None] for row in scores.sampled]
    sampled = [row for row in sampled if row]
    flat = [s for row in sampled for s in row]
    out: dict[str, float] = {
        M.EVAL_ACCURACY: sum(greedy) / len(greedy) if greedy else math.nan,
        **_wilson_keys(M.EVAL_ACCURACY, greedy),
        # Mean over scorable completions, as before intervals existed (= the mean of per-problem means).
        M.EVAL_MEAN_AT_K: sum(flat) / len(flat) if flat else math.nan,
        **_bootstrap_keys(M.EVAL_MEAN_AT_K, [sum(row) / len(row) for row in sampled]),
    }
    if sampled:
        k = len(sampled[0])
        correct = torch.tensor([int(sum(row)) for row in sampled])  # [P]
        per_problem = pass_at_k(correct, num_samples=k, k=k).tolist()
        out[M.EVAL_PASS_AT_K] = sum(per_problem) / len(per_problem)
        out.update(_bootstrap_keys(M.EVAL_PASS_AT_K, per_problem))
    out[M.EVAL_NUM_PROBLEMS] = float(len(greedy))
    return out


def _mean(values: list[float | None]) -> tuple[float, list[float]]:
    known = [v for v in values if v is not None]
    return (sum(known) / len(known) if known else math.nan), known


def _reward_keys(scores: ProblemScores) -> dict[str, float]:
    """eval.reward's mean over the problems' greedy completions and each function's, with a percentile
    bootstrap interval over problems (a reward is no 0/1 rate, so no Wilson interval); the unscorable
    completions are out of the means and counted, the failed calls counted."""
    if scores.reward is None:
        return {}
    mean, known = _mean(scores.reward)
    out = {M.EVAL_REWARD_MEAN: mean, **_bootstrap_keys(M.EVAL_REWARD_MEAN, known)}
    for name, values in scores.rewards.items():
        key = M.EVAL_REWARD_FN_MEAN.format(name)
        out[key], known_fn = _mean(values)
        out.update(_bootstrap_keys(key, known_fn))
    out[M.EVAL_REWARD_UNSCORABLE] = float(len(scores.reward) - len(known))
    out[M.EVAL_REWARD_ERRORS] = float(scores.reward_errors)
    return out


def _per_problem(scores: ProblemScores) -> dict[str, dict[str, float]]:
    """id -> the problem's accuracy, mean@k, pass@k and boxed (scorable problems only)."""
    rows: dict[str, dict[str, float]] = {}
    for pid, g, samples, boxed in zip(scores.ids, scores.greedy, scores.sampled, scores.boxed):
        known = [s for s in samples if s is not None]
        if g is None or not known:
            continue
        k = len(known)
        rows[pid] = {
            M.EVAL_ACCURACY: g,
            M.EVAL_MEAN_AT_K: sum(known) / k,
            M.EVAL_PASS_AT_K: float(pass_at_k(torch.tensor([int(sum(known))]), num_samples=k, k=k)[0]),
            M.EVAL_BOXED_FRACTION: boxed,
        }
    return rows


def paired_change(
    before: ProblemScores, after: ProblemScores, dataset: str | None = None
) -> dict[str, float]:
    """The change of each rate over the problems scored in both evaluations: the interval of the mean
    paired difference (bootstrap over problems) and, for greedy accuracy and boxed, the flip counts; and
    the same interval for eval.reward's mean over the problems both rewards scored.

    Only the interval and flip keys: the change's value itself stays `after - before` of the logged rates.
    """
    out: dict[str, float] = {}
    if before.graded and after.graded:
        a, b = _per_problem(after), _per_problem(before)
        common = [pid for pid in b if pid in a]
        for key in M.EVAL_RATES:
            x = torch.tensor([b[pid][key] for pid in common], dtype=torch.float64)  # [P]
            y = torch.tensor([a[pid][key] for pid in common], dtype=torch.float64)  # [P]
            out.update(_paired_interval(key, x, y))
            if key in (M.EVAL_ACCURACY, M.EVAL_BOXED_FRACTION):
                up, down = flip_counts(x, y)
                out[key + M.FLIPS_UP], out[key + M.FLIPS_DOWN] = float(up), float(down)
        out[M.EVAL_NUM_PROBLEMS] = float(len(common))
        out.update(_paired_buckets(before, after, a, b))
    if before.reward is not None and after.reward is not None:
        b_reward, a_reward = dict(zip(before.ids, before.reward)), dict(zip(after.ids, after.reward))
        common = [pid for pid, r in b_reward.items() if r is not None and a_reward.get(pid) is not None]
        x = torch.tensor([b_reward[pid] for pid in common], dtype=torch.float64)  # [P]
        y = torch.tensor([a_reward[pid] for pid in common], dtype=torch.float64)  # [P]
        out.update(_paired_interval(M.EVAL_REWARD_MEAN, x, y))
    return {M.eval_key(key, dataset): value for key, value in out.items()}


def _paired_buckets(
    before: ProblemScores, after: ProblemScores, a: dict[str, dict], b: dict[str, dict]
) -> dict[str, float]:
    """Per eval.group_by value: the paired interval and flips of pass@1 over the bucket's problems scored
    in both evaluations (a problem's bucket as the later evaluation recorded it)."""
    if before.groups is None or after.groups is None:
        return {}
    out: dict[str, float] = {}
    bucket_of = dict(zip(after.ids, after.groups))
    for value in sorted(set(after.groups)):
        common = [pid for pid in b if pid in a and bucket_of.get(pid) == value]
        x = torch.tensor([b[pid][M.EVAL_ACCURACY] for pid in common], dtype=torch.float64)  # [P]
        y = torch.tensor([a[pid][M.EVAL_ACCURACY] for pid in common], dtype=torch.float64)  # [P]
        key = M.EVAL_PASS_AT_1_BY.format(value)
        if common:
            out.update(_paired_interval(key, x, y))
        up, down = flip_counts(x, y)
        out[key + M.FLIPS_UP], out[key + M.FLIPS_DOWN] = float(up), float(down)
    return out


def _paired_interval(key: str, x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
    _, (low, high) = paired_difference(x, y, num_resamples=BOOTSTRAP_RESAMPLES, seed=BOOTSTRAP_SEED)
    return {key + M.CI_LOW: float(low), key + M.CI_HIGH: float(high)}


def problems_path(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / PROBLEMS_DIR / f"step_{step}.json"


def write_problems(run_dir: str | Path, step: int, sets: dict[str, ProblemScores]) -> Path:
    """One evaluation's per-problem results, every held-out set (name -> scores; DEFAULT_SET: data.*)."""
    path = problems_path(run_dir, step)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({name: s.to_json() for name, s in sets.items()}))
    tmp.replace(path)  # a kill mid-write never leaves a torn file for the resumed run to pair with
    return path


def read_problems(run_dir: str | Path, step: int) -> dict[str, ProblemScores]:
    """The per-problem results of step `step` ({} when that evaluation left none, e.g. an older run)."""
    path = problems_path(run_dir, step)
    if not path.exists():
        return {}
    return {name: ProblemScores.from_json(data) for name, data in json.loads(path.read_text()).items()}
