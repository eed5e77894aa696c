"""Where the generation worker of rollout=async runs (grpo_run/asynchronous/placement.py): rollout.device resolved
against the trainer's device and the GPUs torch sees, the worker's CUDA_VISIBLE_DEVICES, and batches
moved between devices. Pure functions: every case runs on the CPU (the `meta` device stands in for a
GPU where tensors must move)."""

import dataclasses
import os

import pytest
import torch

from grpo_run.asynchronous.placement import (
    own_device,
    spawn_environment,
    tensors_to,
    training_gpus,
    visible_device,
    worker_device,
    worker_environment,
)
from grpo_run.config import ConfigError
from tests.builders import compose_config

CPU, CUDA0, CUDA1 = torch.device("cpu"), torch.device("cuda", 0), torch.device("cuda", 1)


@pytest.mark.parametrize(
    "value,trainer,training,gpus,expected",
    [
        ("cpu", CPU, 1, 0, CPU),
        ("cpu", CUDA0, 1, 2, CPU),  # a GPU trainer may still sample on the CPU
        ("auto", CPU, 1, 0, CPU),
        ("auto", CPU, 1, 4, CPU),  # a CPU trainer keeps its worker on the CPU, GPUs or not
        ("auto", CUDA0, 1, 2, CUDA1),  # one process trains on cuda:0, the worker takes cuda:1
        ("auto", CUDA0, 4, 5, torch.device("cuda", 4)),  # zero2 on 4 ranks: cuda:0-3 train, cuda:4
        ("auto", CUDA0, 4, 8, torch.device("cuda", 4)),  # the first GPU no rank uses
        ("cuda:1", CUDA0, 1, 2, CUDA1),
        ("cuda:0", CUDA0, 1, 1, CUDA0),  # the one-GPU setting: the trainer's own GPU
        ("cuda:3", CPU, 1, 4, torch.device("cuda", 3)),  # a CPU trainer, a GPU worker
        ("cuda:2", CUDA0, 2, 3, torch.device("cuda", 2)),
    ],
)
def test_the_worker_device_resolves_every_placement(value, trainer, training, gpus, expected):
    assert worker_device(value, trainer, training, gpus) == expected


@pytest.mark.parametrize(
    "value,trainer,training,gpus,message",
    [
        ("auto", CUDA0, 1, 1, r"rollout\.device='auto'.*cuda:1.*torch sees 1 GPU.*ask for 2 GPUs"),
        ("auto", CUDA0, 4, 4, r"rollout\.device='auto'.*cuda:4.*torch sees 4 GPU.*rollout\.device=cuda:0"),
        ("cuda:2", CUDA0, 1, 2, r"rollout\.device='cuda:2': torch sees 2 GPU\(s\).*cuda:0 \.\. cuda:1"),
        ("cuda:0", CPU, 1, 0, r"rollout\.device='cuda:0': torch sees 0 GPU\(s\)"),
        ("gpu", CPU, 1, 0, r"rollout\.device='gpu': must be auto, cpu or cuda:N"),
        ("cuda", CUDA0, 1, 2, r"rollout\.device='cuda': must be auto, cpu or cuda:N"),
        ("cuda:-1", CUDA0, 1, 2, r"rollout\.device='cuda:-1': must be"),
        ("cuda:x", CUDA0, 1, 2, r"rollout\.device='cuda:x': must be"),
        ("CPU", CPU, 1, 0, r"rollout\.device='CPU': must be"),
        ("", CPU, 1, 0, r"rollout\.device='': must be"),
    ],
)
def test_a_placement_the_node_cannot_serve_is_a_config_error_naming_the_key(
    value, trainer, training, gpus, message
):
    with pytest.raises(ConfigError, match=message):
        worker_device(value, trainer, training, gpus)


def test_training_gpus_are_the_ranks_of_the_node():
    assert training_gpus(compose_config(["model=tiny", "eval.every_steps=0"])) == 1
    zero2 = ["distributed=zero2", "distributed.nproc_per_node=4", "trainer.prompts_per_step=4"]
    zero2 += ["trainer.micro_batch_size=8"]
    assert training_gpus(compose_config(["model=tiny", "eval.every_steps=0", *zero2])) == 4


@pytest.mark.parametrize(
    "index,parent,expected",
    [
        (3, None, "3"),  # the parent sees every GPU: the child names it by the same index
        (1, "4,5,6", "5"),  # translated through the parent's own list
        (0, "7", "7"),
        (1, " 2, 3 ", "3"),
        (1, "GPU-aaaa,GPU-bbbb", "GPU-bbbb"),  # UUIDs pass on as the parent named them
    ],
)
def test_the_worker_sees_its_gpu_as_the_parent_names_it(index, parent, expected):
    assert visible_device(index, parent) == expected


def test_a_gpu_beyond_the_parents_list_is_named():
    with pytest.raises(ConfigError, match=r"rollout\.device='cuda:2': CUDA_VISIBLE_DEVICES='0,1' lists 2"):
        visible_device(2, "0,1")


def test_the_worker_environment_hides_every_other_gpu():
    assert worker_environment(CPU, None) == {"CUDA_VISIBLE_DEVICES": ""}
    assert worker_environment(CPU, "0,1") == {"CUDA_VISIBLE_DEVICES": ""}
    assert worker_environment(CUDA1, None) == {"CUDA_VISIBLE_DEVICES": "1"}
    assert worker_environment(CUDA1, "2,3") == {"CUDA_VISIBLE_DEVICES": "3"}
    assert own_device(CUDA1) == CUDA0 and own_device(CPU) == CPU


def test_spawn_environment_puts_the_variables_back(monkeypatch):
    monkeypatch.setenv("GRPO_RUN_TEST_SET", "before")
    monkeypatch.delenv("GRPO_RUN_TEST_UNSET", raising=False)
    with spawn_environment({"GRPO_RUN_TEST_SET": "during", "GRPO_RUN_TEST_UNSET": "during"}):
        assert os.environ["GRPO_RUN_TEST_SET"] == os.environ["GRPO_RUN_TEST_UNSET"] == "during"
    assert os.environ["GRPO_RUN_TEST_SET"] == "before" and "GRPO_RUN_TEST_UNSET" not in os.environ


@dataclasses.dataclass
class Inner:
    ids: torch.Tensor
    names: list[str]
    lp: torch.Tensor | None = None


@dataclasses.dataclass(frozen=True)
class Outer:
    kept: Inner | None
    described: Inner
    counts: tuple[dict, dict]
    seconds: float


def batch() -> Outer:
    inner = Inner(torch.arange(6).view(2, 3), ["a", "b"], torch.ones(2, 3))
    return Outer(inner, inner, ({"n": torch.tensor(2.0)}, {"s": 1.5}), 0.25)


def test_tensors_move_and_shared_parts_stay_shared():
    before = batch()
    moved = tensors_to(before, torch.device("meta"))  # any device other than the tensors' own
    assert moved.kept is moved.described  # kept groups = described groups: moved once, still one object
    assert moved.kept.ids.device.type == moved.kept.lp.device.type == "meta"
    assert moved.counts[0]["n"].device.type == "meta" and moved.counts[1] == {"s": 1.5}
    assert moved.kept.names == ["a", "b"] and moved.seconds == 0.25
    assert before.kept.ids.device == CPU  # the original is left as it was


def test_tensors_already_on_the_device_are_not_copied():
    before = batch()
    assert tensors_to(before, CPU) is before
    assert tensors_to([before, None], CPU)[0] is before


def test_the_worker_copy_takes_the_dtypes_the_trainer_sends():
    """DeepSpeed's bf16 mode trains bf16 weights: the worker's float32 copy becomes bf16, a tied weight
    stays one tensor, so the flat buffers split as the trainer flattened them."""
    from grpo_run.asynchronous.worker import match_dtypes

    model = torch.nn.ModuleDict(
        {"embed": torch.nn.Embedding(5, 4), "head": torch.nn.Linear(4, 5, bias=False)}
    )
    model["head"].weight = model["embed"].weight
    params = [p for _, p in model.named_parameters()]
    match_dtypes(params, (torch.bfloat16,))
    assert model["embed"].weight.dtype == torch.bfloat16 and model["head"].weight is model["embed"].weight
    with pytest.raises(
        RuntimeError, match="the trainer sends 2 tensors per weight sync, the worker's model has 1"
    ):
        match_dtypes(params, (torch.bfloat16, torch.float32))
