"""The first step's self-check: packed and padded log-probs of one micro-batch compared; an attention
that leaks across the packed sequences (a deliberately leaking mask, on both forwards) turns packing off
for the run with one line naming the model and the largest difference; a teacher's log-probs packed
equal its padded ones."""

import pytest
import torch

from grpo_run import micro_batches as rollout_micro_batches
from grpo_run.micro_batches import micro_batches_for
from grpo_run.models import forward as plain_forward
from grpo_run.native import forward as native_forward
from grpo_run.packing import PackingState, Piece
from grpo_run.packing.check import TOLERANCE, largest_difference, off_line
from grpo_run.passes import frozen_logprobs
from grpo_run.rollout.generate import Rollout
from tests.native.builders import build
from tests.packing.batches import spread_rows
from tests.packing.test_forward import forward_of


def rollout() -> Rollout:
    p, pm, c, cm = spread_rows()
    return Rollout(p, pm, c, cm, truncated=torch.zeros(len(p), dtype=torch.bool))


class Lines:
    def __init__(self) -> None:
        self.said: list[str] = []

    def print(self, text, **_):
        self.said.append(text)


def packed_forward(kind: str, autocast: bool = False):
    forward = forward_of(kind, share=kind == "native", autocast=autocast)
    forward.packing = PackingState(budget=None, share_prompts=kind == "native")
    return forward


def leak_native(monkeypatch):
    """The native forward with one causal span over the whole packed row: each sequence sees the ones
    before it."""
    real = native_forward.pack_rows

    def leaking(*args, **kwargs):
        pack = real(*args, **{**kwargs, "share_prompts": False})
        return type(pack)(**{**vars(pack), "pieces": (Piece(0, pack.ids.size(1)),)})

    monkeypatch.setattr(native_forward, "pack_rows", leaking)


def leak_hf(monkeypatch):
    """transformers' forward given an all-ones mask: plain causal attention over the packed row."""
    monkeypatch.setattr(plain_forward, "packed_attention_mask", lambda pack: torch.ones_like(pack.ids))


@pytest.mark.parametrize("kind", ["native", "hf"])
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16"])
def test_an_exact_forward_passes_its_check_and_stays_packed(kind, autocast, monkeypatch):
    """Under bf16 autocast too: float32 weights are checked in float32 (autocast off for the check only)."""
    lines = Lines()
    monkeypatch.setattr(rollout_micro_batches, "console", lines)
    model, forward = build("llama"), packed_forward(kind, autocast)
    plans = micro_batches_for(rollout(), forward, model, 3)
    assert all(isinstance(p, torch.Tensor) for p in plans)
    assert forward.packing.checked and forward.packing.enabled and lines.said == []
    assert forward.packing.largest_difference <= 1e-5
    assert forward.autocast_bf16 is autocast  # restored after the check


@pytest.mark.parametrize("kind,leak", [("native", leak_native), ("hf", leak_hf)])
@pytest.mark.parametrize("arch,autocast", [("llama", False), ("qwen3", False), ("llama", True)])
def test_a_leaking_mask_is_caught_and_turns_packing_off_with_one_line(
    kind, leak, arch, autocast, monkeypatch
):
    lines = Lines()
    monkeypatch.setattr(rollout_micro_batches, "console", lines)
    leak(monkeypatch)
    model, forward = build(arch), packed_forward(kind, autocast)
    model.name_or_path = f"tiny-{arch}"
    plans = micro_batches_for(rollout(), forward, model, 3)
    assert plans == [slice(0, 3), slice(3, 6)]  # padded from the first step on
    state = forward.packing
    assert state.checked and not state.enabled
    assert state.largest_difference > TOLERANCE[torch.float32]
    assert lines.said == [off_line(f"tiny-{arch}", state.largest_difference, torch.float32)]
    assert f"tiny-{arch}" in lines.said[0] and "trainer.padding_free: off" in lines.said[0]
    assert micro_batches_for(rollout(), forward, model, 3) == [slice(0, 3), slice(3, 6)]
    assert len(lines.said) == 1  # checked once per run


def test_largest_difference_reads_only_completion_tokens_and_counts_nan_as_infinite():
    packed = torch.tensor([[0.0, 1.0], [5.0, 9.0]])
    padded = torch.tensor([[0.5, 1.0], [5.0, 0.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    assert largest_difference(packed, padded, mask) == 0.5  # the 9 is past row 1's completion
    packed[0, 1] = float("nan")
    assert largest_difference(packed, padded, mask) == float("inf")


@pytest.mark.parametrize("kind", ["native", "hf"])
def test_a_teachers_logprobs_packed_equal_its_padded_ones(kind):
    """distill=teacher scores with `frozen_logprobs` on its own forward: another model (qwen2) over the
    student's rollout, packed and padded."""
    teacher = build("qwen2")
    packed = frozen_logprobs(rollout(), forward=packed_forward(kind), model=teacher, micro_batch_size=4)
    padded = frozen_logprobs(rollout(), forward=forward_of(kind), model=teacher, micro_batch_size=4)
    mask = rollout().completion_mask.bool()
    assert (packed - padded)[mask].abs().max() <= 1e-5
    assert (packed[~mask] == 0).all()
