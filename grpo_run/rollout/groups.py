"""The first stages of a step: prompts → a rollout → scored groups (with DAPO's dynamic sampling).

Row b·G + g of every tensor here is completion g of group b.
"""

import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple

import torch
from transformers import PreTrainedTokenizerBase

from grpo_run import metrics as M
from grpo_run.algo import zero_std_groups
from grpo_run.config.schema import Config, DataConfig, EnvConfig, GenerationConfig, TrainerConfig
from grpo_run.data import Example, PromptSampler
from grpo_run.data.prompts import encode_prompts
from grpo_run.envs.base import Environment, Message
from grpo_run.rewards.call_cost import call_cost_reward
from grpo_run.rollout.engines import GenerationEngine
from grpo_run.rollout.episodes import ChatTurns, Episodes, run_episodes, tool_free_flags
from grpo_run.rollout.filtering import concat_rollouts, group_rows, informative_groups, take_rows
from grpo_run.rollout.generate import Rollout, SamplingParams, group_seed
from grpo_run.safety.stop import stop_requested
from grpo_run.scoring.dispatch import UserInputs
from grpo_run.scoring.run_scorer import RunScorer
from grpo_run.scoring.tally import ScoreResult
from grpo_run.scoring.user import RewardTrainerState


@dataclass
class ScoredGroups:
    """B groups of G completions with their rewards."""

    examples: list[Example]  # [B] the groups' prompts, in row order
    rollout: Rollout
    rewards: torch.Tensor  # [B, G]
    valid: torch.Tensor  # [B, G] bool: scorable
    scores: ScoreResult  # per-function values of these rows (error counts were logged per round)
    # env != single_turn: each row's episode as turns (role, text), for the completions table
    turns: list[list[Message]] | None = None
    # env.tool_free_share > 0: [B, G] bool, the episodes played with the tool disabled
    tool_free: torch.Tensor | None = None


class Sampled(NamedTuple):
    groups: ScoredGroups | None  # the groups the update learns from; None: none has a learning signal
    described: ScoredGroups  # the groups the step's reward statistics describe
    generate_s: float  # seconds spent generating, every round
    tokens: torch.Tensor  # [] prompt + completion tokens of every round


def rank_share(examples: list, *, rank: int, world_size: int) -> list:
    """This rank's contiguous B/world prompts: every rank draws the same B, whole groups stay on one rank."""
    share = len(examples) // world_size
    return examples[rank * share : (rank + 1) * share]


def group_seeds(t: TrainerConfig, step: int, round_index: int, *, rank: int, n: int) -> list[int]:
    """The noise seed of each of this rank's n groups: (seed, step, global prompt index).

    round_index: the generation round within the step (dynamic sampling); every (round, step, prompt)
    gets its own index, and round 0 keeps the indices of a run without resampling.
    """
    # Global prompt index (this rank's share starts at rank * share): samples match a one-process run.
    first_index = (step - 1) * t.prompts_per_step + rank * n
    first_index += round_index * t.max_steps * t.prompts_per_step
    return [group_seed(t.seed, step, first_index + i) for i in range(n)]


def generate(
    engine: GenerationEngine,
    tokenizer: PreTrainedTokenizerBase,
    examples: list[Example],
    seeds: list[int],
    *,
    data: DataConfig,
    sampling: GenerationConfig,
    group_size: int,
    device: torch.device,
) -> Rollout:
    """G completions for each prompt, each group's noise seeded by its entry of `seeds`."""
    ids, mask = encode_prompts(tokenizer, data, examples, device)
    s = sampling
    params = SamplingParams(
        s.max_new_tokens, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, min_p=s.min_p
    )
    return engine.generate(ids, mask, group_size=group_size, params=params, seeds=seeds)


def generate_episodes(
    engine: GenerationEngine,
    env: Environment,
    tokenizer: PreTrainedTokenizerBase,
    examples: list[Example],
    seeds: list[int],
    stats: M.StepMetrics,
    *,
    cfg: Config,
    device: torch.device,
) -> Episodes:
    """G multi-turn episodes for each prompt (`rollout/episodes.py`), counted in env/*."""
    ids, mask = encode_prompts(tokenizer, cfg.data, examples, device)
    s = cfg.generation
    params = SamplingParams(
        s.max_new_tokens, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, min_p=s.min_p
    )
    eos_id = tokenizer.eos_token_id
    done = run_episodes(
        engine,
        env,
        ChatTurns(tokenizer, eos_id),
        examples,
        ids,
        mask,
        group_size=cfg.grpo.group_size,
        params=params,
        seeds=seeds,
        limits=cfg.env,
        eos_id=eos_id,
        pad_id=tokenizer.pad_token_id,
        tool_free=tool_free_flags(len(examples), cfg.grpo.group_size, cfg.env.tool_free_share),
    )
    record_episode_stats(stats, done)
    return done


def record_episode_stats(stats: M.StepMetrics, done: Episodes) -> None:
    n = len(done.episodes)
    stats.add_mean(M.ENV_TURNS_MEAN, sum(e.model_turns for e in done.episodes), n)
    stats.add_mean(M.ENV_TOOL_CALLS_MEAN, sum(e.tool_calls for e in done.episodes), n)
    stats.add_sum(M.ENV_TOOL_ERRORS, sum(e.tool_errors for e in done.episodes))
    stats.add_sum(M.ENV_TOOL_TIMEOUTS, sum(e.tool_timeouts for e in done.episodes))
    stats.add_sum(M.ENV_EPISODES_CUT_BY_TURNS, sum(e.cut_by_turns for e in done.episodes))
    stats.add_mean(M.ENV_OBSERVATION_TOKENS_MEAN, sum(e.observation_tokens for e in done.episodes), n)


def score(
    rewards: RunScorer,
    tokenizer: PreTrainedTokenizerBase,
    examples: list[Example],
    rollout: Rollout,
    stats: M.StepMetrics,
    *,
    device: torch.device,
    episodes: Episodes | None = None,
    step: int = 0,
) -> ScoredGroups:
    """Rewards [B, G] for the decoded completions of one round (G rows of `rollout` per example, in
    order); reward failures are counted here.

    episodes (multi-turn): reward= scores each episode's last model turn, and an environment's own final
    reward replaces the total where it gave one, then env.call_cost (`episodes.limits`) is taken off for
    each episode's tool calls (`rewards/call_cost.py`). step: what a user's reward function receives as
    `step`."""
    g, rest = divmod(rollout.completion_ids.shape[0], len(examples))
    assert rest == 0, f"{rollout.completion_ids.shape[0]} rows for {len(examples)} examples"
    if episodes is None:
        completions = tokenizer.batch_decode(rollout.completion_ids, skip_special_tokens=True)
    else:
        completions = episodes.final_answers
    prompts = [e.question for e in examples for _ in range(g)]
    answers = [e.answer for e in examples for _ in range(g)]
    lengths = rollout.completion_lengths.tolist()
    state = rewards.trainer_state(step)
    inputs = user_inputs(examples, rollout, g, lengths, step, state) if rewards.wants_columns else None
    scores = rewards(prompts, completions, answers, lengths, inputs)
    if episodes is not None:
        given = [e.reward for e in episodes.episodes]
        scores.total = [r if r is not None else t for r, t in zip(given, scores.total, strict=True)]
        env = episodes.limits
        if env is not None and env.call_cost > 0:
            record_call_cost(stats, scores, [e.tool_calls for e in episodes.episodes], env)
    stats.add_sum(M.REWARD_ERRORS, scores.errors)
    for name, errors in scores.errors_by_function.items():
        stats.add_sum(M.REWARD_FN_ERRORS.format(name), errors)
    stats.add_sum(M.REWARD_TIMEOUTS, scores.timeouts)
    stats.add_sum(M.REWARD_UNSCORABLE, scores.unscorable)
    stats.add_mean(M.REWARD_FAILED_FRACTION, scores.unrewarded, len(completions))
    stats.add_sum(M.REWARD_WORKER_RESTARTS, scores.restarts)
    for label, count in scores.labels.items():  # e.g. train/rewards/code_exec/timeout
        stats.add_sum(M.REWARD_FN_OUTCOME.format(label), count)
    valid = torch.tensor([r is not None for r in scores.total], device=device).view(-1, g)  # [B, G]
    values = torch.tensor([0.0 if r is None else r for r in scores.total], device=device).view(-1, g)
    turns = None if episodes is None else [e.turns for e in episodes.episodes]
    tool_free = None  # [B, G] with env.tool_free_share > 0
    if episodes is not None and episodes.limits is not None and episodes.limits.tool_free_share > 0:
        tool_free = torch.tensor([e.tool_free for e in episodes.episodes], device=device).view(-1, g)
    return ScoredGroups(list(examples), rollout, values, valid, scores, turns, tool_free)


def record_call_cost(stats: M.StepMetrics, scores: ScoreResult, calls: list[int], env: EnvConfig) -> None:
    """scores.total [N] after the cost of each episode's `calls` [N]; the mean taken off per scorable
    episode is env/call_cost_mean."""
    before = scores.total
    scores.total = call_cost_reward(before, calls, env.call_cost, env.cost_form)
    removed = [b - a for b, a in zip(before, scores.total, strict=True) if b is not None]
    stats.add_mean(M.ENV_CALL_COST_MEAN, sum(removed), len(removed))


def record_bucket_stats(
    stats: M.StepMetrics,
    examples: list[Example],
    group_size: int,
    totals: list[float | None],
    episodes: Episodes | None,
    *,
    group_by: str,
    buckets: tuple[str, ...],
) -> None:
    """Per value of eval.group_by: the mean reward of the bucket's scorable completions and, with an
    environment, the share of its episodes that called a tool. Every bucket is added, in `buckets`' order,
    even with nothing sampled: the ranks' accumulators then hold the same keys in the same order for the
    one reduction (StepMetrics.reduce drops a mean that counted nothing)."""
    rows = [str(e.columns[group_by]) if group_by in e.columns else None for e in examples]
    for value in buckets:
        mine = [b * group_size + j for b, v in enumerate(rows) if v == value for j in range(group_size)]
        known = [r for r in (totals[i] for i in mine) if r is not None]
        stats.add_mean(M.TRAIN_REWARD_MEAN_BY.format(value), sum(known), len(known))
        if episodes is not None:
            called = sum(episodes.episodes[i].tool_calls > 0 for i in mine)
            stats.add_mean(M.TRAIN_TOOL_CALL_RATE_BY.format(value), called, len(mine))


def user_inputs(
    examples: list[Example],
    rollout: Rollout,
    group_size: int,
    lengths: list[int],
    step: int,
    trainer_state: RewardTrainerState | None = None,
) -> UserInputs:
    """What a user's reward function receives (TRL's call): each example's prompt as the dataset gave it
    (its messages, or the question), every column of its record, the completion's token ids, the step and
    TRL's `trainer_state`."""
    rows = [e for e in examples for _ in range(group_size)]
    prompts = [list(e.messages) if e.messages is not None else e.question for e in rows]
    names = list(dict.fromkeys(name for e in examples for name in e.columns))
    columns = {name: [e.columns.get(name) for e in rows] for name in names}
    ids = rollout.completion_ids.tolist()  # [N, T] one host copy per round
    columns["completion_ids"] = [row[:n] for row, n in zip(ids, lengths, strict=True)]
    return UserInputs(prompts=prompts, columns=columns, step=step, trainer_state=trainer_state)


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


@dataclass(frozen=True)
class GroupSampler:
    """The sampling side of a step, built once: what turns a step's prompts into scored groups. The
    synchronous loop holds one (rollout.source.SyncRollouts), so does the generation worker of
    rollout=async; `sample_groups` reads nothing else.

    environment: a multi-turn environment (env != single_turn, cfg.env's limits), None: one completion per
    row. rank, world_size, ranks_max: this process's share of each step's prompts, and the MAX over the
    training ranks (`Engine.all_reduce_max`) by which their dynamic-sampling rounds agree."""

    cfg: Config  # reads grpo, trainer (seeds), data (prompt format), generation (sampling), env
    sampler: PromptSampler
    generation: GenerationEngine
    tokenizer: PreTrainedTokenizerBase
    rewards: RunScorer
    device: torch.device
    environment: Environment | None = None
    rank: int = 0
    world_size: int = 1
    ranks_max: Callable[[torch.Tensor], torch.Tensor] = _identity

    @cached_property
    def buckets(self) -> tuple[str, ...]:
        """eval.group_by's values over the training examples, sorted (none when it is null): the per-bucket
        train/* keys, known before the first step."""
        column = self.cfg.eval.group_by
        return () if column is None else self.sampler.column_values(column)


class _Round(NamedTuple):
    groups: ScoredGroups
    generate_s: float
    tokens: torch.Tensor  # [] prompt + completion tokens


def _sample_round(side: GroupSampler, step: int, round_index: int, examples: list[Example], stats) -> _Round:
    """One generation round of `examples` (this rank's share), scored."""
    cfg = side.cfg
    seeds = group_seeds(cfg.trainer, step, round_index, rank=side.rank, n=len(examples))
    t = time.perf_counter()
    episodes = None
    if side.environment is None:
        rollout = generate(
            side.generation,
            side.tokenizer,
            examples,
            seeds,
            data=cfg.data,
            sampling=cfg.generation,
            group_size=cfg.grpo.group_size,
            device=side.device,
        )
    else:
        episodes = generate_episodes(
            side.generation,
            side.environment,
            side.tokenizer,
            examples,
            seeds,
            stats,
            cfg=cfg,
            device=side.device,
        )
        rollout = episodes.rollout
    generate_s = time.perf_counter() - t
    tokens = rollout.completion_mask.sum() + rollout.prompt_mask.sum()
    groups = score(
        side.rewards,
        side.tokenizer,
        examples,
        rollout,
        stats,
        device=side.device,
        episodes=episodes,
        step=step,
    )
    if cfg.eval.group_by is not None:  # per bucket, over every completion sampled (the scored totals)
        g = groups.rewards.shape[1]
        totals = groups.scores.total
        record_bucket_stats(
            stats, examples, g, totals, episodes, group_by=cfg.eval.group_by, buckets=side.buckets
        )
    return _Round(groups, generate_s, tokens)


def sample_groups(step: int, stats: M.StepMetrics, side: GroupSampler) -> Sampled:
    """Generation rounds of B prompts until the step has its groups.

    One round; with grpo.filter_zero_std (DAPO's dynamic sampling) groups whose rewards are all equal
    are dropped and new prompts sampled, at most grpo.max_resample_rounds rounds, until B informative
    groups are kept (fewer when the bound is hit). Surplus informative groups of the last round are
    discarded. Every scored completion is counted, and every dropped one by its cause
    (`record_sampled_counts`). Reward statistics describe the kept groups (all generated ones when none
    is kept).

    Several ranks each fill their own B/world share. They go through the rounds together: every rank
    draws every round's prompts (the samplers stay in step; a rank already full generates nothing), a
    round follows while any rank is short, and every rank then keeps as many groups as the rank that kept
    the fewest: each rank's share of the step is equal, as without resampling, and all skip the update
    together when one kept none.
    """
    g, device, ranks_max = side.cfg.grpo, side.device, side.ranks_max
    scored: list[ScoredGroups] = []
    kept: list[ScoredGroups] = []
    generate_s, tokens, dropped = 0.0, torch.zeros((), device=device), torch.zeros((), device=device)
    surplus = torch.zeros((), device=device)  # informative groups past what a round needed
    for round_index in range(g.max_resample_rounds if g.filter_zero_std else 1):
        examples = rank_share(side.sampler.next_batch(), rank=side.rank, world_size=side.world_size)
        if g.filter_zero_std and round_index > 0 and sum(len(k.examples) for k in kept) == len(examples):
            if not _another_round(ranks_max, False, device):  # full here; another rank asked for this round
                break
            continue
        groups, seconds, round_tokens = _sample_round(side, step, round_index, examples, stats)
        generate_s += seconds
        tokens = tokens + round_tokens
        scored.append(groups)
        if not g.filter_zero_std:
            kept.append(groups)
            break
        zero_std = zero_std_groups(groups.rewards, valid=groups.valid)  # [B]
        dropped = dropped + zero_std.sum()
        need = len(examples) - sum(len(k.examples) for k in kept)
        informative = informative_groups(zero_std, need)
        surplus = surplus + (~zero_std).sum() - len(informative)
        if informative:
            kept.append(select_groups(groups, informative, g.group_size))
        if not _another_round(ranks_max, len(informative) < need, device):
            break
    n_kept = sum(len(k.examples) for k in kept)
    if g.filter_zero_std:
        kept = _first_groups(kept, _fewest(ranks_max, n_kept, device))
    cut = n_kept - sum(len(k.examples) for k in kept)  # groups past the rank that kept the fewest
    record_sampled_counts(stats, scored, dropped, surplus, cut)
    stats.add_sum(M.DROPPED_GROUPS, dropped)
    stats.add_max(M.GENERATION_ROUNDS, len(scored))
    described = concat_groups(kept or scored, side.tokenizer.pad_token_id)
    return Sampled(described if kept else None, described, generate_s, tokens)


def record_sampled_counts(
    stats: M.StepMetrics, scored: list[ScoredGroups], zero_std, surplus, rank_balance: int
) -> None:
    """Completions scored this step and those dropped before the update, by cause (counts of groups in,
    of completions out): the first terms of the accounting `safety/accounting.py` checks."""
    group_size = scored[0].rewards.size(1)
    stats.add_sum(M.SCORED_COMPLETIONS, sum(s.rewards.numel() for s in scored))
    stats.add_sum(M.DROPPED_ZERO_STD, zero_std * group_size)
    stats.add_sum(M.DROPPED_SURPLUS, surplus * group_size)
    stats.add_sum(M.DROPPED_RANK_BALANCE, rank_balance * group_size)


def _another_round(
    ranks_max: Callable[[torch.Tensor], torch.Tensor], short: bool, device: torch.device
) -> bool:
    """True on every rank when some rank is short of groups and no rank was asked to stop (the same answer
    everywhere, in one collective: the rounds stay in step)."""
    vote = 2 if stop_requested() else int(short)  # 2: stop, 1: another round, 0: done here
    return int(ranks_max(torch.tensor(vote, device=device)).item()) == 1


def _fewest(ranks_max: Callable[[torch.Tensor], torch.Tensor], count: int, device: torch.device) -> int:
    return -int(ranks_max(torch.tensor(-count, device=device)).item())


def _first_groups(kept: list[ScoredGroups], n: int) -> list[ScoredGroups]:
    """The first n groups of the rounds' kept groups (every rank trains on as many)."""
    out, left = [], n
    for part in kept:
        if left == 0:
            break
        if len(part.examples) > left:
            part = select_groups(part, list(range(left)), part.rewards.size(1))
        out.append(part)
        left -= len(part.examples)
    return out


def select_groups(groups: ScoredGroups, chosen: list[int], group_size: int) -> ScoredGroups:
    """The scored groups restricted to whole groups, in the order given."""
    rows = group_rows(chosen, group_size)
    index = torch.tensor(chosen, dtype=torch.long, device=groups.rewards.device)  # [k]
    scores = ScoreResult(
        total=[groups.scores.total[i] for i in rows],
        per_function={name: [v[i] for i in rows] for name, v in groups.scores.per_function.items()},
    )
    examples = [groups.examples[i] for i in chosen]
    turns = None if groups.turns is None else [groups.turns[i] for i in rows]
    tool_free = None if groups.tool_free is None else groups.tool_free[index]
    return ScoredGroups(
        examples,
        take_rows(groups.rollout, rows),
        groups.rewards[index],
        groups.valid[index],
        scores,
        turns,
        tool_free,
    )


def concat_groups(parts: list[ScoredGroups], pad_id: int) -> ScoredGroups:
    """Scored groups of several rounds as one, rows in order."""
    if len(parts) == 1:
        return parts[0]
    names = parts[0].scores.per_function
    scores = ScoreResult(
        total=[x for p in parts for x in p.scores.total],
        per_function={name: [x for p in parts for x in p.scores.per_function[name]] for name in names},
    )
    return ScoredGroups(
        [e for p in parts for e in p.examples],
        concat_rollouts([p.rollout for p in parts], pad_id),
        torch.cat([p.rewards for p in parts]),  # [B, G]
        torch.cat([p.valid for p in parts]),  # [B, G]
        scores,
        None if any(p.turns is None for p in parts) else [t for p in parts for t in p.turns],
        None if any(p.tool_free is None for p in parts) else torch.cat([p.tool_free for p in parts]),
    )


def record_reward_stats(
    stats: M.StepMetrics, groups: ScoredGroups, bounds: tuple[float, float] | None
) -> None:
    """Rewards, zero-std groups (split at the reward's bounds; not split when a reward's range is unknown),
    completion lengths and truncation."""
    rewards, valid, rollout = groups.rewards, groups.valid, groups.rollout
    stats.add_rewards(rewards, valid.to(rewards.dtype))
    for name, values in groups.scores.per_function.items():
        known = [x for x in values if x is not None]
        stats.add_mean(M.REWARD_FN_MEAN.format(name), sum(known), len(known))
    zero_std = zero_std_groups(rewards, valid=valid)  # [B]
    first = rewards[:, 0]  # [B] the common value of a zero-std group
    stats.add_mean(M.FRAC_REWARD_ZERO_STD, zero_std.sum(), zero_std.numel())
    if bounds is not None:
        lo, hi = bounds
        stats.add_mean(M.FRAC_ALL_CORRECT, (zero_std & (first >= hi)).sum(), zero_std.numel())
        stats.add_mean(M.FRAC_ALL_WRONG, (zero_std & (first <= lo)).sum(), zero_std.numel())
    lengths = rollout.completion_lengths.to(torch.float64)  # [N]
    stats.add_mean(M.COMPLETION_LEN_MEAN, lengths.sum(), lengths.numel())
    stats.add_max(M.COMPLETION_LEN_MAX, lengths.max())
    stats.add_mean(M.TRUNCATED_FRACTION, rollout.truncated.sum(), rollout.truncated.numel())


def record_tool_free_stats(stats: M.StepMetrics, groups: ScoredGroups) -> None:
    """env.tool_free_share > 0: the scorable episodes' mean reward, tool-free and with the tool, over the
    groups the step's reward statistics describe."""
    if groups.tool_free is None:
        return
    free, valid = groups.tool_free, groups.valid  # [B, G]
    for key, rows in ((M.TOOL_FREE_REWARD_MEAN, free & valid), (M.TOOL_REWARD_MEAN, ~free & valid)):
        stats.add_mean(key, groups.rewards[rows].sum(), rows.sum())


def completion_rows(tokenizer, groups: ScoredGroups, advantages: torch.Tensor, step: int) -> list[dict]:
    """One row per completion for the completions table: what was asked, answered and rewarded. With an
    environment the completion is the episode, each turn on its own lines after its role."""
    g = groups.rewards.size(1)
    texts = tokenizer.batch_decode(groups.rollout.completion_ids, skip_special_tokens=True)
    values = advantages.tolist()  # [N] one host copy, on table steps only
    nan = float("nan")  # an unscorable completion has no reward; a table column keeps one type
    rows = []
    for i, text in enumerate(texts):
        example = groups.examples[i // g]
        if groups.turns is not None:
            text = "\n".join(f"[{m.role}] {m.content}" for m in groups.turns[i])
        row = {"step": step, "prompt": example.question, "completion": text, "gold": example.answer}
        row |= {name: nan if v[i] is None else v[i] for name, v in groups.scores.per_function.items()}
        total = groups.scores.total[i]
        row |= {"reward": nan if total is None else total, "advantage": values[i]}
        rows.append(row)
    return rows
