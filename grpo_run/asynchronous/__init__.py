"""rollout=async, in one box: a generation worker process samples and scores the coming steps' groups
while the trainer updates. Behind `rollout.source.RolloutSource`; built by the run context only, and
nothing in the loop, the update or the evaluation imports it.

    source.py          the trainer's side: AsyncRollouts (one process), RankShares (ZeRO-2 ranks)
    worker.py          the worker process: its model copy, its GroupSampler, lockstep, the hand-off
    weight_channel.py  the trainer -> worker weights over torch.distributed (NCCL between GPUs, else gloo)
    placement.py       which device the worker runs on (rollout.device), and what crosses on the CPU

A resumed run's worker starts from the checkpoint's weights: the batches the interrupted run had in flight
are sampled again, with the same prompts and seeds, by those weights (as verl and TRL resume).
"""

from collections.abc import Callable, Sequence

import torch
from transformers import PreTrainedModel

from grpo_run.asynchronous.placement import CPU
from grpo_run.asynchronous.source import AsyncRollouts, RankShares, RolloutWorkerError
from grpo_run.data import Example
from grpo_run.rollout.groups import GroupSampler
from grpo_run.rollout.source import RolloutSource

__all__ = ["AsyncRollouts", "RankShares", "RolloutWorkerError", "build_async_rollouts"]


def build_async_rollouts(
    side: GroupSampler,
    *,
    policy: PreTrainedModel,
    lora: bool,
    examples: Sequence[Example],
    start_step: int,
    scatter: Callable[[list | None], object],
) -> RolloutSource:
    """rollout=async for the training process `side` describes (its config, sampler, tokenizer, rank and
    device; its engine and scorer stay unused). Build it after a resume restored the weights and the
    sampler. scatter: `Engine.scatter_objects` (several ranks)."""

    def worker(to: torch.device) -> AsyncRollouts:
        return AsyncRollouts(
            side.cfg,
            policy=policy,
            lora=lora,
            tokenizer=side.tokenizer,
            examples=examples,
            sampler=side.sampler,
            start_step=start_step,
            device=to,
        )

    if side.world_size == 1:
        return worker(side.device)
    # Rank 0 scatters the shares as pickled objects: on the CPU, each rank then moves its own share.
    return RankShares(
        worker(CPU) if side.rank == 0 else None,
        sampler=side.sampler,
        world_size=side.world_size,
        scatter=scatter,
        device=side.device,
    )
