"""env=python_tool: code in <python> runs in the code sandbox; output, errors and timeouts come back."""

from grpo_run.data.example import Example
from grpo_run.envs.base import Message
from grpo_run.envs.python_tool import PythonTool

EXAMPLE = Example("What is 2**10?", "1024", "0")


def turn(text: str) -> list[Message]:
    return [Message("assistant", text)]


def test_stdout_comes_back_as_the_observation():
    r = PythonTool(timeout_s=10).step(EXAMPLE, turn("<python>print(2**10)</python>"))
    assert (r.observation, r.tool_called, r.tool_error, r.tool_timeout) == ("1024\n", True, False, False)


def test_an_exception_is_an_error_observation():
    r = PythonTool(timeout_s=10).step(EXAMPLE, turn("<python>print('before')\n1/0</python>"))
    assert r.tool_called and r.tool_error and not r.tool_timeout
    assert r.observation.startswith("before") and "ZeroDivisionError" in r.observation


def test_a_hanging_tool_is_cut_by_its_timeout_and_counted():
    r = PythonTool(timeout_s=1.0).step(EXAMPLE, turn("<python>while True:\n    pass</python>"))
    assert r.tool_called and r.tool_timeout and not r.tool_error
    assert "timeout" in r.observation


def test_a_turn_without_code_ends_the_episode():
    r = PythonTool().step(EXAMPLE, turn("The answer is 1024."))
    assert r.observation is None and not r.tool_called
