"""The environment protocol: what a multi-turn rollout asks after every model turn.

An environment is a function of the example and the episode so far, nothing else: it keeps no state
between calls, so G episodes of a group, the groups of a step and a resumed run all ask it the same
questions and get the same answers. After each model turn it either answers with an observation (the
text of a tool turn, appended to the context) or ends the episode; when it ends the episode it may give
the final reward itself, or leave it to the configured `reward=` (which then scores the last model turn).

The episode runner (`grpo_run/rollout/episodes.py`) owns the tokens: it cuts observations to
`env.max_observation_chars`, templates them as a tool turn, and enforces `env.max_turns` and
`env.max_total_tokens`. An environment only sees and returns text.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from grpo_run.data.example import Example

ASSISTANT = "assistant"
TOOL = "tool"  # an observation; templated with the chat template's tool role where it has one


@dataclass(frozen=True)
class Message:
    role: str  # ASSISTANT (a model turn) or TOOL (an observation)
    content: str


@dataclass(frozen=True)
class EnvResponse:
    """The environment's answer to the latest model turn."""

    observation: str | None = None  # None: the episode ends with this turn
    reward: float | None = None  # the episode's reward when it ends; None: reward= scores the last turn
    tool_called: bool = False  # the turn called a tool (env/tool_calls_mean)
    tool_error: bool = False  # the call failed: bad input, an exception, a crash (env/tool_errors)
    tool_timeout: bool = False  # the call was cut by its timeout (env/tool_timeouts)


class Environment(Protocol):
    def step(self, example: Example, turns: Sequence[Message]) -> EnvResponse:
        """`turns`: the episode so far, model turns (ASSISTANT) and observations (TOOL), ending with the
        model turn just sampled. Must not raise for anything the model wrote: a bad call is an
        observation saying so (`tool_error=True`)."""
        ...


@runtime_checkable
class DetectsCalls(Protocol):
    """An environment that can tell whether a model turn calls its tool without running it: what
    env.tool_free_share needs to answer a tool-free episode's call with "tool unavailable"."""

    def calls_tool(self, example: Example, turns: Sequence[Message]) -> bool:
        """Whether the latest model turn (`turns[-1]`) calls the tool; nothing is executed."""
        ...
