"""Run by test_distributed.py under `torch.distributed.run --nproc-per-node=2`: DeepSpeedEngine's
checkpoint, agreement and non-finite-step contract on CPU ranks. Exits non-zero on any failure."""

import sys
from pathlib import Path

import torch

from grpo_run.config.schema import LRScheduler
from grpo_run.engine.deepspeed_engine import DeepSpeedEngine, deepspeed_config
from grpo_run.engine.launch import init_process_group, shutdown
from grpo_run.engine.schedule import lr_factor

init_process_group("cpu", "127.0.0.1", 29500, timeout_s=600)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
config = deepspeed_config(
    zero_stage=2,
    offload_optimizer=False,
    bf16=False,
    micro_batch_size=1,
    completions_per_step=2,
    world_size=2,
    max_grad_norm=1.0,
)
engine = DeepSpeedEngine(
    model,
    lr=0.1,
    weight_decay=0.0,
    betas=(0.9, 0.99),
    lr_factor=lr_factor(LRScheduler.LINEAR, warmup_steps=3, max_steps=10),
    ds_config=config,
    device=torch.device("cpu"),
)


def params() -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def step(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 10 + engine.rank)  # different data on each rank
    engine.backward(engine.module(torch.randn(4, 8, generator=g)).pow(2).mean())
    return engine.step()


step(1)
engine.save_state(Path(sys.argv[1]))
engine.barrier()
saved, saved_lr = params(), engine.current_lr()
step(2), step(3)
continued = params()
engine.load_state(Path(sys.argv[1]))
assert all(torch.equal(a, b) for a, b in zip(saved, params())), "weights not restored"
assert engine.current_lr() == saved_lr, (
    engine.current_lr(),
    saved_lr,
)  # the warmup-then-linear schedule restored
step(2), step(3)
# Adam's moments were restored too: the resumed steps repeat the uninterrupted ones exactly.
assert all(torch.equal(a, b) for a, b in zip(continued, params())), "resume diverged"

assert engine.broadcast_flag(engine.rank == 1) is True  # one rank's flag reaches every rank
assert engine.broadcast_flag(False) is False

before, lr = params(), engine.current_lr()
x = torch.full((1, 8), float("nan") if engine.rank == 0 else 1.0)  # a NaN gradient on rank 0 only
engine.backward(engine.module(x).sum())
norm = engine.step()
assert not torch.isfinite(norm), norm  # every rank sees the non-finite norm
assert all(torch.equal(a, b) for a, b in zip(before, params())), "a non-finite step changed weights"
assert engine.current_lr() == lr
print(f"rank {engine.rank}: engine contract ok", flush=True)
# Leave the process group as the trainer does (atexit): a rank that exits with gloo's threads still up
# can abort in teardown ("terminate called without an active exception", seen once in CI).
engine.barrier()
shutdown()
