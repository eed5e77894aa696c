"""Multi-turn episodes: G per prompt, each alternating model turns and an environment's observations.

Token in, token out. An episode's tokens are the prompt, then each turn's sampled ids exactly as the
engine returned them (trainable 1, with the sampler's log-probs where the engine reports them), then the
observation's ids (trainable 0): the end of the assistant turn after its EOS as the chat template writes
it, the tool turn, and the next assistant turn's opening. The history is never decoded and re-tokenized:
the next turn's prompt is the previous prompt's ids with these ids appended, so every turn continues
exactly the tokens the model saw (`ChatTurns`).

Batching: every still-active episode of the round samples its next turn in one engine call; episodes
that ended drop out. Each turn after the first continues its episode's history (`turns.py`): the native
decoder keeps each row's KV cache and prefills only the tokens appended since the row's last sampled
one; any other engine gets the grown history as a new prompt (vLLM's prefix cache reuses its prefill).

Tool-free episodes (env.tool_free_share): flagged episodes play the same prompt with the tool disabled.
A turn that calls the tool (`DetectsCalls.calls_tool`, nothing run) gets the observation
`TOOL_UNAVAILABLE` and counts as a call; a turn without one goes to `env.step` as usual.

Limits (env.*): `max_turns` model turns; `max_total_tokens` model + observation tokens after the
prompt (a turn's sampling budget shrinks to what is left; an episode over it ends truncated);
observations cut to `max_observation_chars`.
"""

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedTokenizerBase

from grpo_run.config.checks.env import tool_free_count
from grpo_run.config.schema import EnvConfig
from grpo_run.data.example import Example
from grpo_run.envs.base import ASSISTANT, TOOL, DetectsCalls, Environment, EnvResponse, Message
from grpo_run.rollout.engines import GenerationEngine
from grpo_run.rollout.generate import Rollout, SamplingParams, group_seed
from grpo_run.rollout.turns import open_turns
from grpo_run.safety.stop import stop_requested

TOOL_UNAVAILABLE = "tool unavailable"  # a tool-free episode's call is answered with this, never run
_MARK = "\x00grpo-run-content\x00"  # stands for a message's content while the template is read


class ChatTurns:
    """The chat template's tokens between two model turns: what follows the model's EOS (the rest of the
    assistant turn's ending, e.g. SmolLM2's newline), the observation's turn and the opening of the next
    assistant turn. The observation goes in the template's tool role when the template has one (it
    renders a `tool` message with its content), else in the user role."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, eos_id: int) -> None:
        self.tokenizer = tokenizer
        self.role = TOOL if self._renders(TOOL) else "user"
        self.eos_text = tokenizer.decode([eos_id])
        base = [{"role": "user", "content": "q"}, {"role": ASSISTANT, "content": _MARK}]
        before = tokenizer.apply_chat_template(base, tokenize=False)
        after = tokenizer.apply_chat_template(
            [*base, {"role": self.role, "content": _MARK + "obs"}], tokenize=False, add_generation_prompt=True
        )
        if not after.startswith(before):
            raise ValueError("the chat template does not extend a conversation by appending to it")
        ending = before[before.rindex(_MARK) + len(_MARK) :]  # the assistant turn's close
        # The model's own EOS ends its turn; what the template writes after it is the observation's.
        self.after_eos = ending[len(self.eos_text) :] if ending.startswith(self.eos_text) else ending
        turn = after[len(before) :]
        self.head, self.foot = turn.split(_MARK + "obs")

    def _renders(self, role: str) -> bool:
        messages = [
            {"role": "user", "content": "q"},
            {"role": ASSISTANT, "content": "a"},
            {"role": role, "content": _MARK},
        ]
        try:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception:  # a template that refuses the role (jinja raise_exception)
            return False
        return _MARK in text

    def observation_ids(self, text: str) -> list[int]:
        """The ids appended after a model turn that ended with EOS: template, content, template.
        The content is tokenized with special-token text split: a tool cannot forge a turn boundary."""
        tok = self.tokenizer
        head = tok(self.after_eos + self.head, add_special_tokens=False).input_ids
        body = tok(text, add_special_tokens=False, split_special_tokens=True).input_ids if text else []
        foot = tok(self.foot, add_special_tokens=False).input_ids
        return [*head, *body, *foot]


@dataclass
class Episode:
    """One episode's tokens after the prompt and what happened in it."""

    prompt: list[int]  # the prompt's ids (no padding)
    ids: list[int] = field(default_factory=list)  # model and observation tokens, in order
    trainable: list[int] = field(default_factory=list)  # 1 model, 0 observation
    logprobs: list[float] = field(default_factory=list)  # the sampler's, 0 on observations
    turns: list[Message] = field(default_factory=list)
    done: bool = False
    truncated: bool = False  # ended without a final answer: a turn without EOS, or out of tokens
    cut_by_turns: bool = False  # the environment wanted another turn past env.max_turns
    reward: float | None = None  # the environment's final reward (None: reward= scores it)
    tool_calls: int = 0
    tool_errors: int = 0
    tool_timeouts: int = 0
    observation_tokens: int = 0
    tool_free: bool = False  # played with the tool disabled (env.tool_free_share)

    def add_model(self, ids: list[int], logprobs: list[float]) -> None:
        self.ids += ids
        self.trainable += [1] * len(ids)
        self.logprobs += logprobs

    def add_observation(self, ids: list[int]) -> None:
        self.ids += ids
        self.trainable += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.observation_tokens += len(ids)

    @property
    def model_turns(self) -> int:
        return sum(m.role == ASSISTANT for m in self.turns)

    @property
    def final_answer(self) -> str:
        """The last model turn: what reward= scores."""
        return next((m.content for m in reversed(self.turns) if m.role == ASSISTANT), "")


@dataclass
class Episodes:
    rollout: Rollout  # B·G rows; completion = model and observation tokens, trainable_mask tells them apart
    episodes: list[Episode]  # [B·G]
    limits: EnvConfig | None = None  # the env settings they were played under (call cost, tool-free share)

    @property
    def final_answers(self) -> list[str]:
        return [e.final_answer for e in self.episodes]


def run_episodes(
    engine: GenerationEngine,
    env: Environment,
    chat: ChatTurns,
    examples: list[Example],
    prompt_ids: torch.Tensor,  # [B, P] left-padded
    prompt_mask: torch.Tensor,  # [B, P]
    *,
    group_size: int,
    params: SamplingParams,
    seeds: list[int],
    limits: EnvConfig,
    eos_id: int,
    pad_id: int,
    tool_free: Sequence[bool] | None = None,
) -> Episodes:
    """G episodes per prompt, every active episode's next turn sampled together. Turn 1 is the
    single-turn call (the same seeds); turn k > 1 seeds episode g of group b with (seed_b, k, g).
    tool_free [B·G]: the episodes played with the tool disabled (`tool_free_flags`); None: none."""
    g = group_size
    episodes = _new_episodes(prompt_ids, prompt_mask, g, tool_free)
    active = list(range(len(episodes)))
    reports_logprobs = True
    turns = open_turns(engine, prompt_ids, prompt_mask, group_size=g, pad_id=pad_id)
    try:
        for turn in range(1, limits.max_turns + 1):
            budget = [limits.max_total_tokens - len(episodes[i].ids) for i in active]
            turn_params = _within_budget(params, max(budget))
            if turn == 1:
                out = turns.first(params=turn_params, seeds=seeds)
            else:
                histories = [episodes[i].prompt + episodes[i].ids for i in active]
                turn_seeds = [group_seed(seeds[i // g], turn, i % g) for i in active]
                out = turns.next(active, histories, params=turn_params, seeds=turn_seeds)
            reports_logprobs &= out.sampler_logprobs is not None
            lengths = out.completion_mask.sum(1).tolist()  # [n]
            ids_host = out.completion_ids.tolist()
            lp_host = out.sampler_logprobs.tolist() if out.sampler_logprobs is not None else None
            for j, i in enumerate(active):
                e, n = episodes[i], min(lengths[j], budget[j])
                sampled = ids_host[j][:n]
                e.add_model(sampled, lp_host[j][:n] if lp_host is not None else [0.0] * n)
                e.turns.append(Message(ASSISTANT, chat.tokenizer.decode(sampled, skip_special_tokens=True)))
                ended = bool(sampled) and sampled[-1] == eos_id
                if n < lengths[j] or (not ended and n == budget[j]):
                    e.done = e.truncated = True  # out of the episode's tokens
                    continue
                response = _answer(env, examples[i // g], e)
                _respond(
                    e, response, chat, limits, last_turn=turn == limits.max_turns, closed=ended, eos_id=eos_id
                )
            active = [i for i in active if not episodes[i].done]
            if not active or stop_requested():  # a stop: no further turn (the caller discards these)
                break
    finally:
        turns.close()
    return Episodes(
        _rollout(episodes, g, prompt_ids, prompt_mask, pad_id, reports_logprobs), episodes, limits
    )


def _new_episodes(
    prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, group_size: int, tool_free: Sequence[bool] | None
) -> list[Episode]:
    """[B·G] empty episodes, G per prompt (its ids without padding), tool-free where flagged."""
    prompts = [row[m.bool()].tolist() for row, m in zip(prompt_ids, prompt_mask, strict=True)]
    free = list(tool_free) if tool_free is not None else [False] * (len(prompts) * group_size)
    assert len(free) == len(prompts) * group_size, f"{len(free)} tool-free flags for {len(prompts)} groups"
    return [Episode(prompt=prompts[i // group_size], tool_free=flag) for i, flag in enumerate(free)]


def tool_free_flags(n_groups: int, group_size: int, share: float) -> list[bool]:
    """[B·G]: episode g of each group is tool-free when g >= G - k, k = round(share x G) (the last k of
    each group: the others keep their seeds and draws, so a run and its resume agree)."""
    k = tool_free_count(share, group_size) if share > 0 else 0
    return [g >= group_size - k for _ in range(n_groups) for g in range(group_size)]


def _answer(env: Environment, example: Example, e: Episode) -> EnvResponse:
    """The environment's answer to the episode's latest turn; a tool-free episode's call is answered
    here, never reaching the tool."""
    if e.tool_free:
        assert isinstance(env, DetectsCalls), "tool-free episodes need an environment that detects calls"
        if env.calls_tool(example, e.turns):
            return EnvResponse(observation=TOOL_UNAVAILABLE, tool_called=True)
    return env.step(example, e.turns)


def _within_budget(params: SamplingParams, budget: int) -> SamplingParams:
    """A turn's sampling settings: `params` with max_new_tokens cut to the largest token budget an active
    episode has left."""
    return SamplingParams(
        min(params.max_new_tokens, budget),
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        min_p=params.min_p,
        greedy=params.greedy,
    )


def _respond(
    e: Episode,
    r: EnvResponse,
    chat: ChatTurns,
    limits: EnvConfig,
    *,
    last_turn: bool,
    closed: bool,
    eos_id: int,
) -> None:
    """Apply the environment's answer to the episode: an observation appended, or the end.

    closed: the turn ended with the model's EOS. A turn cut by generation.max_new_tokens may still call
    a tool: the EOS that closes it is then the observation's first token (trainable 0, never sampled);
    a cut turn that ends the episode leaves it truncated."""
    e.tool_calls += int(r.tool_called)
    e.tool_errors += int(r.tool_error)
    e.tool_timeouts += int(r.tool_timeout)
    if r.observation is None:
        e.done, e.reward, e.truncated = True, r.reward, not closed
        return
    if last_turn:
        e.done = e.cut_by_turns = True
        e.truncated = not closed
        return
    text = r.observation[: limits.max_observation_chars]
    ids = ([] if closed else [eos_id]) + chat.observation_ids(text)
    if len(e.ids) + len(ids) >= limits.max_total_tokens:  # no room left for another model token
        e.done = e.truncated = True
        return
    e.turns.append(Message(TOOL, text))
    e.add_observation(ids)


def _rollout(
    episodes: list[Episode],
    group_size: int,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    pad_id: int,
    with_logprobs: bool,
) -> Rollout:
    n, width = len(episodes), max(1, max(len(e.ids) for e in episodes))
    ids = torch.full((n, width), pad_id, dtype=torch.long)  # [N, T]
    mask = torch.zeros((n, width), dtype=torch.long)  # [N, T] model and observation tokens
    trainable = torch.zeros((n, width), dtype=torch.long)  # [N, T] model tokens
    logprobs = torch.zeros((n, width), dtype=torch.float32)  # [N, T]
    for k, e in enumerate(episodes):
        t = len(e.ids)
        ids[k, :t] = torch.tensor(e.ids, dtype=torch.long)
        mask[k, :t] = 1
        trainable[k, :t] = torch.tensor(e.trainable, dtype=torch.long)
        logprobs[k, :t] = torch.tensor(e.logprobs, dtype=torch.float32)
    device = prompt_ids.device
    return Rollout(
        prompt_ids=prompt_ids.repeat_interleave(group_size, dim=0),
        prompt_mask=prompt_mask.repeat_interleave(group_size, dim=0),
        completion_ids=ids.to(device),
        completion_mask=mask.to(device),
        truncated=torch.tensor([e.truncated for e in episodes], dtype=torch.bool, device=device),
        sampler_logprobs=logprobs.to(device) if with_logprobs else None,
        trainable_mask=trainable.to(device),
    )
