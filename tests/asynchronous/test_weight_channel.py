"""The trainer -> generation worker weight sync (grpo_run/asynchronous/weight_channel.py) between two real
processes: the worker's copy equals the trainer's bit for bit after every sync, versions arrive in order,
and the trainer may change its weights as soon as `send` returns."""

import time

import pytest
import torch
import torch.distributed as dist

from grpo_run.asynchronous.weight_channel import (
    GLOO,
    NCCL,
    TRAINER,
    WORKER,
    WeightChannel,
    channel_backend,
    flatten,
    joined,
    open_store,
    pack,
    sync_tensors,
)

READY = "ready"


def tied_model(seed: int) -> torch.nn.Module:
    """An embedding tied to its output head (one parameter under two names), a float32 and a bf16 layer."""
    torch.manual_seed(seed)
    model = torch.nn.ModuleDict(
        {
            "embed": torch.nn.Embedding(11, 6),
            "mid": torch.nn.Linear(6, 6).to(torch.bfloat16),
            "head": torch.nn.Linear(6, 11, bias=False),
        }
    )
    model["head"].weight = model["embed"].weight
    return model


def worker(port: int, syncs: int, out, done) -> None:
    torch.set_num_threads(1)
    model = tied_model(seed=123)  # other values: every one must come from the trainer
    channel = WeightChannel(WORKER, port=port, timeout_s=60, ready_key=READY)
    flats = pack([p for _, p in model.named_parameters()])  # the parameters become views of these
    held = -1
    for _ in range(syncs):
        while not channel.sent_after(held):  # as the generation worker waits: polled, never timed out
            time.sleep(0.005)
        version = held = channel.receive(flats)
        out.put((version, {k: v.clone() for k, v in model.state_dict().items()}))
    done.wait(60)  # shared tensors must outlive their reading


def test_the_worker_gets_every_version_bit_for_bit():
    mp = torch.multiprocessing.get_context("spawn")
    store, port = open_store(60)
    out, done = mp.Queue(), mp.Event()
    proc = mp.Process(target=worker, args=(port, 3, out, done))
    proc.start()
    try:
        while not joined(store, READY):
            assert proc.is_alive()
        channel = WeightChannel(TRAINER, port=port, timeout_s=60, store=store)
        model = tied_model(seed=0)
        expected, sent = [], []
        for version in (0, 1, 2):
            sent.append(flatten(sync_tensors(model, lora=False)))
            channel.send(version, sent[-1])
            expected.append({k: v.clone() for k, v in model.state_dict().items()})
            with torch.no_grad():  # the next "optimizer step" starts while the sync may be in flight
                for p in model.parameters():
                    p.add_(0.25)
        channel.wait()
        assert channel.done()
        for version in (0, 1, 2):
            got_version, state = out.get(timeout=60)
            assert got_version == version
            assert state.keys() == expected[version].keys()
            for key, value in expected[version].items():
                assert state[key].dtype == value.dtype and torch.equal(state[key], value), key
            assert torch.equal(state["head.weight"], state["embed.weight"])
    finally:
        done.set()
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    assert proc.exitcode == 0


def test_sync_tensors_lists_tied_weights_once_in_parameter_order():
    model = tied_model(seed=0)
    tensors = sync_tensors(model, lora=False)
    params = [p for _, p in model.named_parameters()]
    assert len(tensors) == len(params) == 3  # embed (= head), mid.weight, mid.bias
    assert all(t.data_ptr() == p.data_ptr() for t, p in zip(tensors, params, strict=True))


CPU = torch.device("cpu")


@pytest.mark.parametrize(
    "trainer,worker,backend",
    [
        (CPU, CPU, GLOO),
        ("cuda:0", CPU, GLOO),  # the trainer's flat buffers go through the host
        (CPU, "cuda:0", GLOO),  # received on the host, copied into the worker's GPU parameters
        ("cuda:0", "cuda:0", GLOO),  # one GPU for both: NCCL refuses two ranks on one device
        ("cuda:3", "cuda:3", GLOO),
        ("cuda:0", "cuda:1", NCCL),
        ("cuda:1", "cuda:0", NCCL),
        ("cuda:0", "cuda:4", NCCL),  # zero2 on 4 ranks, rank 0 and the worker on the fifth GPU
        ("cuda", "cuda:1", NCCL),  # no index: the first GPU
    ],
)
def test_the_backend_follows_where_the_two_sides_are(trainer, worker, backend):
    assert channel_backend(torch.device(trainer), torch.device(worker)) == backend


@pytest.mark.skipif(dist.is_nccl_available(), reason="this torch build has NCCL")
def test_nccl_on_a_torch_without_it_says_what_to_do():
    store, port = open_store(5)
    with pytest.raises(RuntimeError, match=r"needs NCCL.*rollout\.device=cpu"):
        WeightChannel(TRAINER, port=port, timeout_s=5, store=store, backend=NCCL, device=torch.device("cpu"))


def test_flatten_lays_each_dtype_out_in_one_buffer_in_parameter_order():
    model = tied_model(seed=0)
    flat = flatten(sync_tensors(model, lora=False))
    assert [b.dtype for b in flat] == [torch.float32, torch.bfloat16]
    assert [b.numel() for b in flat] == [11 * 6, 6 * 6 + 6]  # embed (= head); mid.weight + mid.bias
    assert torch.equal(flat[0], model["embed"].weight.detach().reshape(-1))
    assert torch.equal(flat[1][:36], model["mid"].weight.detach().reshape(-1))


def test_pack_makes_the_parameters_views_of_the_flat_buffers():
    model = tied_model(seed=0)
    x = torch.tensor([[1, 4, 7]])
    before = model["head"](model["mid"](model["embed"](x).bfloat16()).float())
    flats = pack([p for _, p in model.named_parameters()])
    after = model["head"](model["mid"](model["embed"](x).bfloat16()).float())
    assert torch.equal(before, after)  # the values did not move
    assert model["head"].weight is model["embed"].weight  # still tied: one parameter
    with torch.no_grad():  # a sync writing into the buffers is what the parameters hold
        flats[0].fill_(0.5)
        flats[1].zero_()
    assert torch.equal(model["embed"].weight, torch.full((11, 6), 0.5))
    assert not model["mid"].weight.any() and not model["mid"].bias.any()
