"""distributed: the ranks, and the step's prompts split evenly over them."""

from grpo_run.config.checks.base import check, fail
from grpo_run.config.schema import Config, DistributedKind


def validate_distributed(cfg: Config) -> None:
    """The step's B prompts split evenly over the ranks (whole groups), each share into micro-batches."""
    d, t, g = cfg.distributed, cfg.trainer, cfg.grpo
    check(d.nproc_per_node >= 1, "distributed.nproc_per_node", d.nproc_per_node, "must be >= 1")
    check(d.nnodes >= 1, "distributed.nnodes", d.nnodes, "must be >= 1")
    check(0 <= d.node_rank < d.nnodes, "distributed.node_rank", d.node_rank, "must lie in [0, nnodes)")
    check(d.zero_stage in (1, 2), "distributed.zero_stage", d.zero_stage, "must be 1 or 2")
    check(d.timeout_s > 0, "distributed.timeout_s", d.timeout_s, "must be > 0 (seconds)")
    bf16 = str(d.bf16).lower()
    check(bf16 in ("auto", "true", "false"), "distributed.bf16", d.bf16, "must be auto, true or false")
    world = d.nproc_per_node * d.nnodes
    if world > 1 and d.kind == DistributedKind.SINGLE:
        fail(
            "distributed.kind",
            d.kind.value,
            f"{world} ranks (distributed.nproc_per_node * distributed.nnodes) need distributed=zero2",
        )
    if t.prompts_per_step % world:
        fail(
            "trainer.prompts_per_step",
            t.prompts_per_step,
            f"must divide by the world size distributed.nproc_per_node * distributed.nnodes = "
            f"{d.nproc_per_node} * {d.nnodes} = {world} (whole groups stay on one rank)",
        )
    completions = t.prompts_per_step * g.group_size
    if completions % (world * t.micro_batch_size):
        fail(
            "trainer.micro_batch_size",
            t.micro_batch_size,
            f"trainer.prompts_per_step * grpo.group_size = {completions} completions must divide by "
            f"world size ({world} = distributed.nproc_per_node * distributed.nnodes) * "
            f"trainer.micro_batch_size = {world * t.micro_batch_size}",
        )
