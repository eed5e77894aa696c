"""Reward functions written as a TRL user writes them, for TRL's GRPOTrainer: the conformance test runs each
through TRL's own trainer and through grpo-run's scorer by `_target_`, unchanged.

`CALLS` records what each function received (its name, then the keywords), in either runner.
"""

import asyncio

import numpy as np
import torch

CALLS: list[tuple[str, dict]] = []


def _text(completion) -> str:
    """A completion's text: a string, or TRL's conversational `[{"role": "assistant", "content": ...}]`."""
    return completion if isinstance(completion, str) else completion[0]["content"]


def math_task(completions, task, solution, **kwargs):
    """A multi-task pair's math half: 1 when the solution appears in the completion; None on code rows."""
    CALLS.append(("math_task", {"completions": completions, "task": task, "solution": solution, **kwargs}))
    return [
        (1.0 if s in _text(c) else 0.0) if t == "math" else None
        for c, t, s in zip(completions, task, solution, strict=True)
    ]


def code_task(completions, task, **kwargs):
    """The code half: 0.5 per `def` (at most 1); None on math rows."""
    CALLS.append(("code_task", {"completions": completions, "task": task, **kwargs}))
    return [min(1.0, 0.5 * _text(c).count("def")) if t == "code" else None for c, t in zip(completions, task)]


def numpy_length(completions, **kwargs):
    """A numpy array, as much TRL code returns: a quarter point per 4 characters, capped at 1."""
    return np.minimum(np.array([len(_text(c)) // 4 for c in completions], dtype=np.float64) / 4, 1.0)


def torch_has_digit(completions, **kwargs):
    """A torch tensor of 0/1: whether the completion holds a digit."""
    return torch.tensor([float(any(ch.isdigit() for ch in _text(c))) for c in completions])


def progress(completions, trainer_state, **kwargs):
    """Reward shaping by the run's progress, as TRL's docs show: records the state's fields, returns 0.25
    x global_step (an exact float)."""
    fields = ("global_step", "max_steps", "epoch", "num_train_epochs")
    CALLS.append(("progress", {name: getattr(trainer_state, name) for name in fields}))
    return [0.25 * trainer_state.global_step for _ in completions]


async def async_exclaims(completions, **kwargs):
    """An `async def` reward: 1 when the completion ends with "!"."""
    await asyncio.sleep(0)
    return [1.0 if _text(c).endswith("!") else 0.0 for c in completions]
