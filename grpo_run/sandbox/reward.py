"""`code_exec`: the reward that runs a completion's code against its problem's tests in the sandbox.

It has the registry's one signature. `prompts` are the problems' prompts (a HumanEval prompt: the function's
signature and docstring), `answers` the tests ending with `check(<entry_point>)` (built by the data loader).
Each completion's program is `prompt + code` (`grpo_run.rewards.code.build_program`); its tests
(`build_tests`) run apart from it, in the sandbox's judge process, against a proxy of its function
(`grpo_run.sandbox.runner.run_sandboxed`). The values are labelled with the outcome kind
(`grpo_run.rewards.code.CodeOutcome`), which the scorer counts as `train/rewards/code_exec/<kind>`.

The scorer runs it in its pool of worker processes (its registry record is isolated), one completion per call;
`wall_s` must stay below `reward.timeout_s`, the pool's own budget (checked by config validation).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from grpo_run.rewards.code import CodeOutcome, build_program, build_tests, code_reward
from grpo_run.rewards.functions import LabelledRewards
from grpo_run.sandbox.limits import Isolation, Limits

KINDS = tuple(kind.value for kind in CodeOutcome)
LIMIT_FIELDS = tuple(field.name for field in dataclasses.fields(Limits))


def code_exec(
    prompts: Sequence[str],
    completions: Sequence[str],
    answers: Sequence[str],
    *,
    fraction: bool = False,
    isolation: str = Isolation.AUTO.value,
    temp_dir: str | None = None,
    **options: Any,
) -> LabelledRewards:
    """1.0 when the tests pass against the program `prompt + code` in the sandbox, else 0.0; None when the
    sandbox itself failed. fraction: the share of `check`'s asserts that passed (each run on its own).
    isolation: an `Isolation` value; temp_dir: where each program's private folder is made (default: TMPDIR
    or /tmp); options: the limits, `Limits`' fields by name (`wall_s`, `cpu_s`, `memory_mb`, `file_mb`,
    `processes`, `open_files`: the config's `reward.functions[i].kwargs.*`), any other keyword ignored.
    """
    from grpo_run.sandbox.runner import run_sandboxed  # not at import: the registry imports this module

    limits = Limits(**{name: options[name] for name in LIMIT_FIELDS if name in options})
    results = [
        run_sandboxed(
            build_program(p, c),
            tests=build_tests(p, a, per_assert=fraction),
            limits=limits,
            isolation=isolation,
            temp_dir=temp_dir,
        )
        for p, c, a in zip(prompts, completions, answers, strict=True)
    ]
    values = [code_reward(r.outcome, r.passed, r.total, fraction=fraction) for r in results]
    return LabelledRewards(values, [r.outcome.value for r in results], KINDS)


def describe_isolation(isolation: str = Isolation.AUTO.value):
    """Run a trivial program once: what the sandbox sets up on this machine (a SandboxResult, for the log)."""
    from grpo_run.sandbox.runner import run_sandboxed

    return run_sandboxed("pass\n", limits=Limits(wall_s=30.0), isolation=isolation)
