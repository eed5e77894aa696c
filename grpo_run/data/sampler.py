"""An epoch-based shuffled prompt sampler whose position can be saved and restored exactly."""

import random
from collections.abc import Sequence
from typing import Any

from grpo_run.data.example import Example


class PromptSampler:
    """Draws batches of distinct examples, reshuffling every epoch.

    Epoch ``e`` visits the examples in the order of a permutation drawn from
    ``random.Random(f"{seed}/{e}")``, so each epoch's order depends only on ``(seed, e)``: a sampler
    restored from :meth:`state_dict` continues with exactly the batches an uninterrupted run would draw.
    Batches never straddle an epoch: the last ``len(examples) % batch_size`` examples of each epoch's
    permutation are left out (as ``drop_last=True`` does), so a batch never holds an example twice.
    Each epoch leaves out different examples, so none is favoured over time.

    Args:
        examples: the examples to draw from (copied).
        seed: the shuffling seed.
        batch_size: examples per batch, ``1 <= batch_size <= len(examples)``.
    """

    def __init__(self, examples: Sequence[Example], *, seed: int, batch_size: int) -> None:
        if not examples:
            raise ValueError("PromptSampler needs at least one example")
        if not 1 <= batch_size <= len(examples):
            raise ValueError(
                f"batch_size must be in [1, {len(examples)}] (the number of examples), got {batch_size}"
            )
        self._examples = tuple(examples)
        self._batch_size = batch_size
        self._seed = seed
        self._epoch = 0
        self._position = 0  # index into this epoch's permutation of the next example to hand out
        self._order = self._permutation(self._epoch)

    def column_values(self, column: str) -> tuple[str, ...]:
        """The distinct values (as text, sorted) that `column` takes over the examples that have it."""
        return tuple(sorted({str(x.columns[column]) for x in self._examples if column in x.columns}))

    @property
    def epoch(self) -> int:
        """The epoch the next batch comes from (0-based)."""
        return self._epoch

    @property
    def batches_per_epoch(self) -> int:
        return len(self._examples) // self._batch_size

    def next_batch(self) -> list[Example]:
        """The next ``batch_size`` examples; starts a new, reshuffled epoch when this one is used up."""
        if self._position + self._batch_size > len(self._order):
            self._epoch += 1
            self._position = 0
            self._order = self._permutation(self._epoch)
        start = self._position
        self._position += self._batch_size
        return [self._examples[i] for i in self._order[start : self._position]]

    def state_dict(self) -> dict[str, Any]:
        """Plain ints only (safe for JSON and ``torch.save``)."""
        return {
            "seed": self._seed,
            "epoch": self._epoch,
            "position": self._position,
            "batch_size": self._batch_size,
            "num_examples": len(self._examples),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``; the seed is taken from it. Refuses a state saved on other data."""
        if state["num_examples"] != len(self._examples):
            raise ValueError(
                f"sampler state was saved with {state['num_examples']} examples, this sampler has "
                f"{len(self._examples)}: the data changed since the checkpoint"
            )
        if state["batch_size"] != self._batch_size:
            raise ValueError(
                f"sampler state was saved with batch_size={state['batch_size']}, this sampler has "
                f"batch_size={self._batch_size}"
            )
        if not 0 <= state["position"] <= len(self._examples) or state["epoch"] < 0:
            raise ValueError(f"sampler state out of range: {state}")
        self._seed = state["seed"]
        self._epoch = state["epoch"]
        self._position = state["position"]
        self._order = self._permutation(self._epoch)

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(len(self._examples)))
        # A string seed is hashed with SHA-512 by `random`: stable across processes and Python versions.
        random.Random(f"{self._seed}/{epoch}").shuffle(order)
        return order
