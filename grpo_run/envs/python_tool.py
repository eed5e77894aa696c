"""`env=python_tool`: `<python>CODE</python>` in a model turn runs in the code sandbox; its output comes back.

The code runs with `grpo_run.sandbox.runner.run_sandboxed` under the same isolation and limits as the
`code_exec` reward (docs/sandbox.md), its wall clock bounded by `env.tool_timeout_s`. The tool turn is the
program's stdout and stderr (the runner cuts them before the episode runner cuts them again to
`env.max_observation_chars`), followed by a line naming an error or the timeout.
"""

import math
from collections.abc import Sequence

from grpo_run.data.example import Example
from grpo_run.envs.base import ASSISTANT, EnvResponse, Message
from grpo_run.envs.tags import tagged_block
from grpo_run.rewards.code import CodeOutcome
from grpo_run.sandbox.limits import Isolation, Limits

TAG = "python"


class PythonTool:
    """The latest model turn's `<python>…</python>` run in the sandbox; a turn without one ends the episode."""

    def __init__(
        self,
        *,
        timeout_s: float = Limits.wall_s,
        isolation: str = Isolation.AUTO.value,
        memory_mb: int = Limits.memory_mb,
        tag: str = TAG,
    ) -> None:
        # The CPU limit follows the wall clock: a busy loop is stopped by whichever comes first.
        self.limits = Limits(wall_s=timeout_s, cpu_s=max(1, math.ceil(timeout_s)), memory_mb=memory_mb)
        self.isolation = Isolation(isolation)
        self.tag = tag

    def calls_tool(self, example: Example, turns: Sequence[Message]) -> bool:
        return tagged_block(turns[-1].content, self.tag) is not None

    def step(self, example: Example, turns: Sequence[Message]) -> EnvResponse:
        last = turns[-1]
        assert last.role == ASSISTANT
        code = tagged_block(last.content, self.tag)
        if code is None:
            return EnvResponse()  # the final answer: reward= scores it
        from grpo_run.sandbox.runner import run_sandboxed  # the sandbox only for runs that call it

        result = run_sandboxed(code, limits=self.limits, isolation=self.isolation)
        output = result.output_tail
        if result.outcome == CodeOutcome.PASSED:
            return EnvResponse(observation=output, tool_called=True)
        if result.outcome == CodeOutcome.TIMEOUT:
            note = f"timeout: the code ran longer than {self.limits.wall_s:g} s and was stopped"
            return EnvResponse(observation=_joined(output, note), tool_called=True, tool_timeout=True)
        note = f"error: {result.outcome.value}" + (f" ({result.detail})" if result.detail else "")
        return EnvResponse(observation=_joined(output, note), tool_called=True, tool_error=True)


def _joined(output: str, note: str) -> str:
    return f"{output.rstrip()}\n{note}" if output.strip() else note
