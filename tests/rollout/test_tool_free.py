"""Tool-free episodes (env.tool_free_share) and the cost per call in scoring (grpo_run/rollout/episodes.py,
groups.py): tool-free episodes never reach the tool, their calls are counted and answered "tool
unavailable"; the flags are the last k of each group; the flag travels with the groups; the metrics and
the cost on hand-built episodes with known rewards."""

from types import SimpleNamespace

import pytest
import torch

from grpo_run import metrics as M
from grpo_run.config import ConfigError
from grpo_run.config.schema import EnvConfig, RewardConfig, RewardFunctionConfig
from grpo_run.data.example import Example
from grpo_run.envs.base import ASSISTANT, TOOL, DetectsCalls, Message
from grpo_run.envs.calculator import Calculator
from grpo_run.envs.python_tool import PythonTool
from grpo_run.envs.registry import build_environment
from grpo_run.models.tiny import build_model, build_tokenizer
from grpo_run.rewards.call_cost import CostForm
from grpo_run.rollout.engines import TransformersEngine
from grpo_run.rollout.episodes import (
    TOOL_UNAVAILABLE,
    ChatTurns,
    Episode,
    Episodes,
    _rollout,
    run_episodes,
    tool_free_flags,
)
from grpo_run.rollout.generate import SamplingParams
from grpo_run.rollout.groups import concat_groups, record_tool_free_stats, score, select_groups
from grpo_run.scoring.run_scorer import RunScorer
from tests.builders import compose_config
from tests.envs.toy import RecordsCalls

SUMS = SimpleNamespace(all_reduce_sum=lambda t: t, all_reduce_max=lambda t: t)  # one process: no reduction


def test_the_flags_are_the_last_k_of_each_group():
    assert tool_free_flags(2, 4, 0.25) == [False, False, False, True] * 2
    assert tool_free_flags(1, 4, 0.5) == [False, False, True, True]
    assert tool_free_flags(1, 3, 0.5) == [False, True, True]  # 1.5 rounds half up
    assert tool_free_flags(2, 4, 0.0) == [False] * 8


def test_the_shipped_tools_detect_a_call_without_running_it():
    ex = Example("q", "1", "0")
    calc, py = Calculator(), PythonTool()
    assert isinstance(calc, DetectsCalls) and isinstance(py, DetectsCalls)
    assert calc.calls_tool(ex, [Message(ASSISTANT, "<calc>1/0</calc>")])
    assert not calc.calls_tool(ex, [Message(ASSISTANT, "it is 3")])
    assert py.calls_tool(ex, [Message(ASSISTANT, "<python>while True: pass</python>")])
    assert not py.calls_tool(ex, [Message(ASSISTANT, "<calc>1</calc>")])


@pytest.mark.parametrize(
    "overrides,match",
    [
        (["env.tool_free_share=1.0"], r"env\.tool_free_share=1\.0: must be in \[0, 1\)"),
        (["env.tool_free_share=-0.5"], r"env\.tool_free_share=-0\.5: must be in \[0, 1\)"),
        (
            ["env.tool_free_share=0.1", "grpo.group_size=4"],
            r"env\.tool_free_share=0\.1: cannot be combined with grpo\.group_size=4: .* = 0 tool-free",
        ),
        (
            ["env.tool_free_share=0.9", "grpo.group_size=4"],
            r"env\.tool_free_share=0\.9: cannot be combined with grpo\.group_size=4: .* = 4 tool-free",
        ),
    ],
)
def test_a_share_that_leaves_no_episode_on_either_side_is_refused(overrides, match):
    with pytest.raises(ConfigError, match=match):
        compose_config(["model=tiny", "env=calculator", *overrides])


def test_a_share_needs_a_tool_and_an_environment_that_detects_calls():
    with pytest.raises(ConfigError, match=r"env\.tool_free_share=0\.5: needs a tool: env=single_turn"):
        compose_config(["model=tiny", "grpo.group_size=4", "env.tool_free_share=0.5"])
    cfg = compose_config(["model=tiny", "env=calculator", "grpo.group_size=4", "env.tool_free_share=0.5"])
    assert isinstance(build_environment(cfg.env), Calculator)
    mine = EnvConfig(name="toy", _target_="tests.envs.toy.AlwaysAnswers", tool_free_share=0.5)
    with pytest.raises(ConfigError, match=r"env\.tool_free_share=0\.5: the environment .*AlwaysAnswers"):
        build_environment(mine)


@pytest.fixture(scope="module")
def tiny():
    tok = build_tokenizer()
    return tok, build_model(tok, seed=0)


def _play(tiny, env, flags, *, group_size=4, max_turns=3):
    tok, model = tiny
    prompts = ("What is 1 + 2?", "What is 7 + 5?")
    enc = tok(
        [
            tok.apply_chat_template(
                [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
            )
            for q in prompts
        ],
        return_tensors="pt",
        padding=True,
        add_special_tokens=False,
    )
    engine = TransformersEngine(model, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id, autocast_bf16=False)
    return run_episodes(
        engine,
        env,
        ChatTurns(tok, tok.eos_token_id),
        [Example(q, "3", str(i)) for i, q in enumerate(prompts)],
        enc.input_ids,
        enc.attention_mask,
        group_size=group_size,
        params=SamplingParams(4),
        seeds=[11, 12],
        limits=EnvConfig(name="toy", max_turns=max_turns, max_total_tokens=200),
        eos_id=tok.eos_token_id,
        pad_id=tok.pad_token_id,
        tool_free=flags,
    )


def test_tool_free_episodes_never_reach_the_tool_and_their_calls_are_counted(tiny):
    """Every turn calls: the tool episodes' calls are all executed, the tool-free ones' none, and each of
    those is answered "tool unavailable" and counted. The tool episodes play as without the share."""
    env = RecordsCalls()
    flags = tool_free_flags(2, 4, 0.5)
    done = _play(tiny, env, flags)
    free = [e for e in done.episodes if e.tool_free]
    tool = [e for e in done.episodes if not e.tool_free]
    assert [e.tool_free for e in done.episodes] == flags
    assert len(env.executed) == sum(e.tool_calls for e in tool) > 0  # only the tool episodes' calls ran
    for e in free:
        assert e.tool_calls == e.model_turns == 3  # every turn called; the last one too, cut by turns
        observations = [m.content for m in e.turns if m.role == TOOL]
        assert observations == [TOOL_UNAVAILABLE] * 2
    alone = _play(tiny, RecordsCalls(), None)
    for i, e in enumerate(done.episodes):
        if not e.tool_free:
            assert e.ids == alone.episodes[i].ids  # the same seeds and draws
    # The first turn of a tool-free episode is the same sample: only what follows differs.
    first = [m.content for m in alone.episodes[3].turns if m.role == ASSISTANT][0]
    assert [m.content for m in done.episodes[3].turns if m.role == ASSISTANT][0] == first


def test_a_tool_free_turn_without_a_call_goes_to_the_environment(tiny):
    """The calculator: the tiny model never writes <calc>, so every episode, tool-free or not, ends after
    its first turn as the environment decides, with no call."""
    done = _play(tiny, Calculator(), tool_free_flags(2, 4, 0.25))
    assert all(e.model_turns == 1 and e.tool_calls == 0 and e.done for e in done.episodes)


def _scored(tool_free, rewards, calls, env):
    """Hand-built episodes whose environment gave each its reward; scored by groups.score."""
    tok = build_tokenizer()
    g = len(rewards) // 2
    episodes = []
    for r, k, free in zip(rewards, calls, tool_free, strict=True):
        e = Episode(prompt=[5, 6], reward=r, tool_calls=k, tool_free=free, done=True)
        e.add_model([7, tok.eos_token_id], [-0.5, -0.5])
        e.turns.append(Message(ASSISTANT, "x"))
        episodes.append(e)
    prompt_ids, prompt_mask = torch.tensor([[5, 6], [5, 6]]), torch.ones(2, 2, dtype=torch.long)
    rollout = _rollout(episodes, g, prompt_ids, prompt_mask, tok.pad_token_id, True)
    stats = M.StepMetrics(torch.device("cpu"))
    scorer = RunScorer(RewardConfig(functions=[RewardFunctionConfig("target_char_fraction")]))
    examples = [Example("q", "1", "0"), Example("q", "1", "1")]
    groups = score(
        scorer,
        tok,
        examples,
        rollout,
        stats,
        device=torch.device("cpu"),
        episodes=Episodes(rollout, episodes, env),
    )
    return groups, stats


def test_the_cost_and_the_tool_free_metrics_on_known_rewards():
    free = [False, False, True, True] * 2
    rewards = [1.0, 0.0, 1.0, 0.5, 0.0, 1.0, None, 0.0]  # None: the environment left it to reward= (0: "x")
    calls = [2, 1, 0, 1, 0, 3, 1, 0]
    env = EnvConfig(name="toy", call_cost=0.5, cost_form=CostForm.MULTIPLICATIVE, tool_free_share=0.5)
    groups, stats = _scored(free, rewards, calls, env)
    after = [0.25, 0.0, 1.0, 0.25, 0.0, 0.125, 0.0, 0.0]
    assert groups.scores.total == after
    assert groups.rewards.view(-1).tolist() == after
    assert groups.tool_free.tolist() == [[False, False, True, True]] * 2
    record_tool_free_stats(stats, groups)
    out = stats.reduce(SUMS)
    assert out[M.ENV_CALL_COST_MEAN] == pytest.approx((0.75 + 0.25 + 0.875) / 8)
    assert out[M.TOOL_REWARD_MEAN] == pytest.approx((0.25 + 0.0 + 0.0 + 0.125) / 4)
    assert out[M.TOOL_FREE_REWARD_MEAN] == pytest.approx((1.0 + 0.25 + 0.0 + 0.0) / 4)
    # The flag travels with whole groups through selection and concatenation.
    picked = select_groups(groups, [1], 4)
    assert picked.tool_free.tolist() == [[False, False, True, True]]
    both = concat_groups([picked, groups], pad_id=0)
    assert both.tool_free.shape == (3, 4) and both.tool_free[:, 2:].all() and not both.tool_free[:, :2].any()


def test_off_the_scores_and_metrics_are_as_before():
    rewards, calls = [1.0, 0.0, 1.0, 0.5, 0.0, 1.0, 0.5, 0.0], [2, 1, 0, 1, 0, 3, 1, 0]
    groups, stats = _scored([False] * 8, rewards, calls, EnvConfig(name="toy"))
    assert groups.scores.total == rewards and groups.tool_free is None
    record_tool_free_stats(stats, groups)
    out = stats.reduce(SUMS)
    assert (
        M.ENV_CALL_COST_MEAN not in out
        and M.TOOL_REWARD_MEAN not in out
        and M.TOOL_FREE_REWARD_MEAN not in out
    )
