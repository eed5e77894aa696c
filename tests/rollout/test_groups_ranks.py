"""Dynamic sampling on several ranks (grpo_run/rollout/groups.sample_groups): 2 processes over gloo,
the real tiny model, sampler and reward. Each rank's 2 prompts need their own number of rounds; the
ranks go through the rounds together (their samplers stay in step) and keep equally many groups."""

import os
import socket
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from grpo_run import metrics as M
from grpo_run.config.schema import Config
from grpo_run.data import PromptSampler
from grpo_run.data.arithmetic import generate_arithmetic
from grpo_run.metrics import StepMetrics
from grpo_run.models.tiny import build_model, build_tokenizer
from grpo_run.rollout.engines import TransformersEngine
from grpo_run.rollout.groups import GroupSampler, sample_groups
from grpo_run.scoring.run_scorer import RunScorer
from tests.builders import compose_config
from tests.helpers import FAST


def _all_max(x: torch.Tensor) -> torch.Tensor:
    out = x.clone()
    dist.all_reduce(out, op=dist.ReduceOp.MAX)
    return out


def _same(x: torch.Tensor) -> torch.Tensor:
    return x


def _rank(rank: int, port: int, cfg: Config, reduce: bool, out) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        tok = build_tokenizer()
        engine = TransformersEngine(
            build_model(tok, seed=0), eos_id=tok.eos_token_id, pad_id=tok.pad_token_id, autocast_bf16=False
        )
        examples = generate_arithmetic(64, seed=0)
        sampler = PromptSampler(examples, seed=0, batch_size=cfg.trainer.prompts_per_step)
        rewards = RunScorer(cfg.reward)
        steps, counts = [], []  # counts: this rank's reduced metrics of each step
        for step in (1, 2):
            stats = StepMetrics(torch.device("cpu"))
            side = GroupSampler(
                cfg,
                sampler=sampler,
                generation=engine,
                tokenizer=tok,
                rewards=rewards,
                device=torch.device("cpu"),
                rank=rank,
                world_size=2,
                ranks_max=_all_max if reduce else (lambda x: x),
            )
            sampled = sample_groups(step, stats, side)
            kept = 0 if sampled.groups is None else len(sampled.groups.examples)
            steps.append((kept, sampler.state_dict()["position"], sampler.state_dict()["epoch"]))
            counts.append(stats.reduce(SimpleNamespace(all_reduce_sum=_same, all_reduce_max=_same)))
        out.put((rank, steps, counts))
    finally:
        dist.destroy_process_group()


def _run(reduce: bool) -> tuple[dict[int, list], dict[int, list[dict]]]:
    """Per rank: (kept groups, sampler position, epoch) and the reduced metrics of each step."""
    cfg = compose_config(
        [
            *FAST,
            "trainer.prompts_per_step=4",
            "grpo.group_size=2",
            "generation.max_new_tokens=2",
            "grpo.filter_zero_std=true",
            "grpo.max_resample_rounds=4",
        ]
    )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, cfg, reduce, out)) for r in range(2)]
    for p in procs:
        p.start()
    steps, counts = {}, {}
    for _ in procs:
        rank, steps[rank], counts[rank] = out.get(timeout=120)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    return steps, counts


def test_ranks_resample_in_step_and_keep_as_many_groups_as_each_other():
    agreed, counts = _run(reduce=True)
    # Every step, both ranks kept the same number of groups and their samplers are at the same batch.
    assert agreed[0] == agreed[1]
    # Every completion a rank scored is kept (2 per group) or counted as dropped by its cause, the
    # groups cut to the rank that kept the fewest included.
    for step, (kept, _, _) in enumerate(agreed[0]):
        for rank in (0, 1):
            c = counts[rank][step]
            dropped = sum(c[k] for k in (M.DROPPED_ZERO_STD, M.DROPPED_SURPLUS, M.DROPPED_RANK_BALANCE))
            assert c[M.SCORED_COMPLETIONS] == 2 * kept + dropped, c
    # Without the agreement the ranks go their own ways: a rank that filled its share early stops
    # drawing while the other resamples, and the samplers part (this data and seed do part).
    apart, _ = _run(reduce=False)
    assert apart[0] != apart[1]
