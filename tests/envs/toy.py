"""Environments the tests plug in through `env._target_` (importable as tests.envs.toy)."""

from collections.abc import Sequence

from grpo_run.data.example import Example
from grpo_run.envs.base import ASSISTANT, EnvResponse, Message


class AlwaysAnswers:
    """Answers every model turn with the same observation: every episode runs to env.max_turns (or out
    of tokens), whatever the model writes."""

    def __init__(self, observation: str = "ok") -> None:
        self.observation = observation

    def step(self, example: Example, turns: Sequence[Message]) -> EnvResponse:
        return EnvResponse(observation=self.observation, tool_called=True)


class KnockTool:
    """A toy tool only the tool call solves: a model turn holding `knock` calls it, and the episode's
    reward is 1 when the tool was called, 0 when the model answered without it. The observation says so,
    and the turn after it ends the episode."""

    def __init__(self, knock: str = "a") -> None:
        self.knock = knock

    def step(self, example: Example, turns: Sequence[Message]) -> EnvResponse:
        called = any(m.role != ASSISTANT for m in turns)  # an observation came back earlier
        if called:
            return EnvResponse(reward=1.0)
        if self.knock in turns[-1].content:
            return EnvResponse(observation="opened", tool_called=True)
        return EnvResponse(reward=0.0)


class RecordsCalls:
    """Every model turn calls the tool (`calls_tool` says so, nothing run); `step` runs it and records the
    call in `executed`, answering "ran": every episode runs to env.max_turns (or out of tokens)."""

    def __init__(self) -> None:
        self.executed: list[tuple[str, int]] = []  # (example id, model turns so far) of each executed call

    def calls_tool(self, example: Example, turns: Sequence[Message]) -> bool:
        return True

    def step(self, example: Example, turns: Sequence[Message]) -> EnvResponse:
        self.executed.append((example.id, sum(m.role == ASSISTANT for m in turns)))
        return EnvResponse(observation="ran", tool_called=True)


class CallsFromColumn:
    """A scripted tool user: an episode calls the tool exactly as many times as its example's `calls`
    column says (0 when it has none), whatever the model writes; each call's observation is answered
    by the next model turn, and the episode ends with reward 0 after the last. Known calls per problem
    for the tests of per-bucket tool metrics."""

    def step(self, example: Example, turns: Sequence[Message]) -> EnvResponse:
        made = sum(m.role != ASSISTANT for m in turns)  # observations so far: one per call
        if made < int(example.columns.get("calls", 0)):
            return EnvResponse(observation="result", tool_called=True)
        return EnvResponse(reward=0.0)
