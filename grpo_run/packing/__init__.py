"""Packed, token-budgeted micro-batches (`trainer.padding_free`): which rows share a micro-batch
(`plan.py`), the rows laid end to end in one row (`pack.py`), and the first step's check that the packed
forward gives the padded forward's log-probs (`check.py`)."""

from grpo_run.packing.check import PackingState
from grpo_run.packing.pack import PackedRows, Piece, pack_rows
from grpo_run.packing.plan import attention_weight, plan_micro_batches, row_units

__all__ = [
    "PackedRows",
    "PackingState",
    "Piece",
    "attention_weight",
    "pack_rows",
    "plan_micro_batches",
    "row_units",
]
