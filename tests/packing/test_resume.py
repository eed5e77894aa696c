"""A packed run resumes exactly: 4 steps in one go against 2 steps, then 2 more from the checkpoint (the
self-check runs again on the resumed run's first step and agrees)."""

import torch
from safetensors.torch import load_file

from grpo_run import metrics as M
from tests.builders import LEARN, whole_and_resumed
from tests.helpers import read_metrics


def without_timings(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if not k.startswith("perf/")} for row in rows]


def test_resume_mid_run_with_packing_is_bitwise_identical(tmp_path):
    args = [*LEARN, "trainer.padding_free=true", "trainer.micro_batch_tokens=120", "grpo.num_iterations=2"]
    whole, resumed = whole_and_resumed(args, tmp_path)
    assert [r["step"] for r in read_metrics(resumed)] == [3, 4]
    assert without_timings(read_metrics(resumed)) == without_timings(read_metrics(whole))[2:]
    assert all(r[M.KL] > 0 for r in read_metrics(whole))
    a = load_file(whole / "final" / "model.safetensors")
    b = load_file(resumed / "final" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
