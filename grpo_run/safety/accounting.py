"""Every scored completion is trained or counted as dropped, never lost between the stages.

The stages each count what they let through and what they leave out (metrics.py: SCORED_COMPLETIONS,
TRAINED_COMPLETIONS, DROPPED_KEYS): sampling counts every completion it scored and the groups dynamic
sampling drops (zero std, surplus, cut to the rank with the fewest), rollout=async the batches too old
to train, the update the rows with no token left in the loss. Their sums are integers summed in float64
over ranks, so the identity scored = trained + dropped holds exactly at every step; a step where it does
not is a bug in grpo-run, and the run stops (exit 1) rather than go on training on fewer samples than it
reports.
"""

from grpo_run import metrics as M


class SampleAccountingError(RuntimeError):
    """A step's scored completions are not all trained or counted as dropped."""


def account_samples(step: int, metrics: dict[str, float]) -> None:
    """Fill in the step's counts a stage did not log (0: nothing went that way), then check the identity.

    metrics: the step's reduced metrics (the same on every rank, so every rank stops together)."""
    for key in (M.SCORED_COMPLETIONS, M.TRAINED_COMPLETIONS, *M.DROPPED_KEYS):
        metrics.setdefault(key, 0.0)
    scored, trained = metrics[M.SCORED_COMPLETIONS], metrics[M.TRAINED_COMPLETIONS]
    dropped = {key: metrics[key] for key in M.DROPPED_KEYS}
    if scored != trained + sum(dropped.values()):
        causes = ", ".join(f"{key}={value:g}" for key, value in dropped.items())
        raise SampleAccountingError(
            f"step {step}: {scored:g} completions were scored, {trained:g} trained and "
            f"{sum(dropped.values()):g} counted as dropped ({causes}): "
            f"{scored - trained - sum(dropped.values()):g} unaccounted for between the stages; this is a "
            "bug in grpo-run (docs/reliability.md: every scored completion is trained or counted as dropped)"
        )
