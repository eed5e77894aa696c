"""What the loop changes as it runs: the step, β, the entropy bonus's controller, the non-finite streak
and the in-flight alarms.

`RunContext` holds what is built once and only read afterwards (models, engines, data, sinks); a
`LoopState` holds the rest, and together with the built parts' own state dicts (the sampler's position,
the engine's weights, optimizer and schedule) it is what a checkpoint carries. Stages read β from it and
the loop alone writes it.
"""

from dataclasses import dataclass

from grpo_run.tracking.alarms import Alarms


@dataclass
class LoopState:
    step: int  # the last finished step: 0 in a fresh run, the checkpoint's step on resume
    # The KL coefficient of the next step: grpo.beta, then steered by kl_control=adaptive.
    beta: float
    # The entropy bonus's coefficient (grpo.entropy_coef, then steered by entropy_control=adaptive) and
    # the last step's measured train/entropy it reacts to (inf before any step measured one).
    entropy_coef: float
    last_entropy: float
    # Optimizer updates skipped in a row for a non-finite loss or gradient.
    nonfinite_streak: int
    # The in-flight alarms: runs that cannot learn, said while they run; their streaks continue on resume.
    alarms: Alarms
    # Steps in a row on which no reward function scored any completion (reward.max_failed_steps).
    reward_failed_streak: int = 0
