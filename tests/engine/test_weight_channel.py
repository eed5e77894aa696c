"""The trainer -> generation worker weight sync (grpo_run/engine/weight_channel.py) between two real
processes: the worker's copy equals the trainer's bit for bit after every sync, versions arrive in order,
and the trainer may change its weights as soon as `send` returns."""

import torch

from grpo_run.engine.weight_channel import TRAINER, WORKER, WeightChannel, flatten, joined, open_store
from grpo_run.rollout_source import sync_tensors

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
    params = [p for _, p in model.named_parameters()]
    for _ in range(syncs):
        version = channel.receive(params)
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
        expected = []
        for version in (0, 1, 2):
            channel.send(version, flatten(sync_tensors(model, lora=False)))
            expected.append({k: v.clone() for k, v in model.state_dict().items()})
            with torch.no_grad():  # the next "optimizer step" starts while the sync may be in flight
                for p in model.parameters():
                    p.add_(0.25)
        channel.wait()
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
