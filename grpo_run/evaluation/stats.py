"""Per-problem held-out results and what is computed from them: the eval/* rates with 95% intervals,
and the paired before/after change with its interval and flip counts (docs/evaluation.md).

The evaluation (grpo_run/evaluation/held_out.py) generates and scores; this module only aggregates. Each
evaluation's per-problem results are kept in the run dir (`eval_problems/step_<N>.json`), so the final
summary of a resumed run still pairs the same problems with its step-0 evaluation.
"""

import json
import math
from dataclasses import asdict, dataclass
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
    """One evaluation of one held-out set, problem by problem (None: the gold cannot be parsed)."""

    ids: list[str]
    greedy: list[float | None]  # greedy answer correct (1/0)
    sampled: list[list[float | None]]  # the k sampled answers of each problem
    boxed: list[float]  # greedy answer holds a non-empty \boxed{}
    lengths: list[int]  # greedy completion length, tokens

    @classmethod
    def from_rows(cls, ids, greedy, sampled_flat, boxed, lengths, *, k: int) -> "ProblemScores":
        """From the evaluation's flat lists (sampled row i·k + j: completion j of problem i)."""
        sampled = [list(sampled_flat[i * k : (i + 1) * k]) for i in range(len(ids))]
        return cls(list(ids), list(greedy), sampled, list(boxed), list(lengths))

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
    correlated, so a binomial over all n·k samples would be too narrow).
    """
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
    out[M.EVAL_BOXED_FRACTION] = sum(scores.boxed) / len(scores.boxed) if scores.boxed else math.nan
    out.update(_wilson_keys(M.EVAL_BOXED_FRACTION, scores.boxed))
    out[M.EVAL_COMPLETION_LEN] = sum(scores.lengths) / len(scores.lengths) if scores.lengths else math.nan
    out[M.EVAL_NUM_PROBLEMS] = float(len(greedy))
    return {M.eval_key(key, dataset): value for key, value in out.items()}


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
    paired difference (bootstrap over problems) and, for greedy accuracy and boxed, the flip counts.

    Only the interval and flip keys: the change's value itself stays `after - before` of the logged rates.
    """
    a, b = _per_problem(after), _per_problem(before)
    common = [pid for pid in b if pid in a]
    out: dict[str, float] = {}
    for key in M.EVAL_RATES:
        x = torch.tensor([b[pid][key] for pid in common], dtype=torch.float64)  # [P]
        y = torch.tensor([a[pid][key] for pid in common], dtype=torch.float64)  # [P]
        _, (low, high) = paired_difference(x, y, num_resamples=BOOTSTRAP_RESAMPLES, seed=BOOTSTRAP_SEED)
        out[key + M.CI_LOW], out[key + M.CI_HIGH] = float(low), float(high)
        if key in (M.EVAL_ACCURACY, M.EVAL_BOXED_FRACTION):
            up, down = flip_counts(x, y)
            out[key + M.FLIPS_UP], out[key + M.FLIPS_DOWN] = float(up), float(down)
    out[M.EVAL_NUM_PROBLEMS] = float(len(common))
    return {M.eval_key(key, dataset): value for key, value in out.items()}


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
