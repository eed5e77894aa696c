"""StepMetrics: which keys a step writes."""

import torch

from grpo_run import metrics as M
from grpo_run.engine.single import SingleProcessEngine


def test_worker_restarts_are_written_only_on_a_step_that_had_one():
    # Summed on every rank (the reductions line up) but left out of a step's metrics when 0, so a run
    # whose workers never die keeps the keys it always had.
    engine = SingleProcessEngine(
        torch.nn.Linear(1, 1),
        lr=0.1,
        weight_decay=0.0,
        betas=(0.9, 0.999),
        lr_factor=lambda step: 1.0,
        max_grad_norm=1.0,
        device=torch.device("cpu"),
    )
    quiet, death = M.StepMetrics(torch.device("cpu")), M.StepMetrics(torch.device("cpu"))
    for stats, restarts in ((quiet, 0), (death, 2)):
        stats.add_sum(M.REWARD_ERRORS, 0)
        stats.add_sum(M.REWARD_WORKER_RESTARTS, restarts)
    assert quiet.reduce(engine) == {M.REWARD_ERRORS: 0.0}
    assert death.reduce(engine) == {M.REWARD_ERRORS: 0.0, M.REWARD_WORKER_RESTARTS: 2.0}
