"""Held-out evaluation: greedy pass@1 (`eval/accuracy`), sampled mean@k and pass@k, each with a 95%
interval over problems (grpo_run/evaluation/stats.py), on data's held-out split and every `eval.datasets` set.

Correctness is the math reward alone (`math_verifier`: the extracted final answer checked with
math-verify, with the data config's last-number fallback), whatever the training reward adds, so
that a format bonus never inflates accuracy. The sampled pass draws k completions per prompt at
`eval.temperature`; its noise is seeded by (trainer.seed, prompt index) only, so an evaluation
before and after training samples with the same noise and two evaluations of one model agree.

With an environment (env != single_turn) every completion is an episode run like training's
(`rollout/episodes.py`, tool calls allowed), its last model turn scored, and `eval/tool_call_rate` is
the share of greedy episodes that called a tool, `eval/calls_per_episode` their mean calls.

`eval.group_by` names a column of the examples (a difficulty bucket): the same greedy results are also
summarized per value of it (`eval/pass@1/<value>`, ...; grpo_run/evaluation/stats.py).

`eval.reward` (grpo_run/evaluation/rewards.py) scores each greedy completion with the run's own reward
entries, as training would, for eval/reward_mean. A set without gold answers has no correctness at all:
no pass@1, and no sampled pass, which would only feed mean@k and pass@k.
"""

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from grpo_run import metrics as M
from grpo_run.config.schema import Config, EvalConfig
from grpo_run.data import Example
from grpo_run.data.prompts import encode_prompts
from grpo_run.envs.base import Environment
from grpo_run.evaluation.progress import EvalProgress
from grpo_run.evaluation.rewards import (
    GreedyRows,
    RewardScores,
    eval_reward_specs,
    has_gold,
    join_user_inputs,
    own_entries,
    score_greedy,
)
from grpo_run.evaluation.stats import (
    DEFAULT_SET,
    ProblemScores,
    summarize,
    write_problems,
)
from grpo_run.rewards import RewardName, format_reward
from grpo_run.rollout.engines import GenerationEngine
from grpo_run.rollout.episodes import ChatTurns, run_episodes
from grpo_run.rollout.generate import SamplingParams, group_seed
from grpo_run.rollout.groups import user_inputs
from grpo_run.safety.stop import raise_if_stopped
from grpo_run.scoring import RewardPool, RewardSpec, UserInputs, score

# Training steps count from 1, so step 0's seeds are never drawn by a training rollout.
_EVAL_STEP = 0


@dataclass
class EvalInputs:
    """What one evaluation needs: the engine that samples from the model, the problems, how to prompt and
    score them."""

    cfg: Config
    tokenizer: PreTrainedTokenizerBase
    examples: list[Example]
    pool: RewardPool
    device: torch.device
    engine: GenerationEngine
    environment: Environment | None = None  # env != single_turn: each completion is an episode
    # The training step whose weights are evaluated (what a user's reward receives as `step`, 0 when None);
    # None: mode=eval.
    step: int | None = None
    name: str = DEFAULT_SET  # the held-out set's name, for the console
    progress: bool = False  # say on the console when it starts and how far it is (the main rank)
    # The training scorer's reward-model workers by name: eval.reward=train shares them.
    reward_pools: Mapping[str, RewardPool] = field(default_factory=dict)


def evaluate(inputs: EvalInputs) -> dict[str, float]:
    """eval/* metrics of the engine's model on the first `eval.num_prompts` held-out examples."""
    scores, seconds, calls = evaluate_problems(inputs)
    tools = inputs.environment is not None
    return {**summarize(scores), **tool_call_rate(tools, calls), M.EVAL_S: seconds}


def tool_call_rate(tools: bool, calls: list[int], dataset: str | None = None) -> dict[str, float]:
    """eval/tool_call_rate (with an environment only): greedy episodes that called a tool at least once."""
    if not tools:
        return {}
    return {M.eval_key(M.EVAL_TOOL_CALL_RATE, dataset): sum(c > 0 for c in calls) / max(len(calls), 1)}


def evaluate_problems(inputs: EvalInputs) -> tuple[ProblemScores, float, list[int]]:
    """Problem by problem: greedy and sampled correctness of the engine's model (where the set has gold
    answers), eval.reward's scores of the greedy completions, the seconds it took, and the tool calls of
    each greedy episode (0s without an environment)."""
    e = inputs.cfg.eval
    examples = inputs.examples[: e.num_prompts]
    if not examples:
        raise ValueError(
            "evaluation needs held-out examples (data.eval_path, or a source with an eval split)"
        )
    graded = has_gold(inputs.cfg.data)
    specs = eval_reward_specs(inputs.cfg)
    k = e.samples_per_prompt if graded else 0
    progress = (
        EvalProgress.start(inputs.name, len(examples), k=k, step=inputs.step) if inputs.progress else None
    )
    t0 = time.perf_counter()
    greedy_params = SamplingParams(e.max_new_tokens, greedy=True)
    greedy = _generate(inputs, examples, k=1, params=greedy_params, progress=progress, rewarded=bool(specs))
    raise_if_stopped()  # an evaluation has no collective inside: a stop ends it here, unlogged
    greedy_correct: list[float | None] = [None] * len(examples)
    sampled_correct: list[float | None] = []
    if graded:
        params = SamplingParams(e.max_new_tokens, e.temperature)
        sampled = _generate(inputs, examples, k=k, params=params, progress=progress)
        raise_if_stopped()
        greedy_correct = correctness(inputs, examples, greedy.texts, k=1)
        sampled_correct = correctness(inputs, examples, sampled.texts, k=k)
    rewards = _reward_scores(inputs, specs, examples, greedy)
    raise_if_stopped()  # the pool abandons its calls on a stop: their scores are no result
    scores = ProblemScores.from_rows(
        [x.id for x in examples],
        greedy_correct,
        sampled_correct,
        format_reward([], greedy.texts, []),
        greedy.lengths,
        k=k,
        graded=graded,
    )
    if rewards is not None:
        scores = replace(
            scores, reward=rewards.total, rewards=rewards.per_function, reward_errors=rewards.errors
        )
    if inputs.environment is not None:
        scores = replace(scores, tool_calls=list(greedy.tool_calls))
    if e.group_by is not None:  # every example has the column: checked when the data loaded
        scores = replace(scores, groups=[str(x.columns[e.group_by]) for x in examples])
    if progress is not None:
        progress.scored()
    return scores, time.perf_counter() - t0, greedy.tool_calls


def _reward_scores(
    inputs: EvalInputs, specs: list[RewardSpec], examples: list[Example], greedy: "_Completions"
) -> RewardScores | None:
    """eval.reward's scores of the greedy completions (None: no entries)."""
    if not specs:
        return None
    rows = GreedyRows(
        questions=[x.question for x in examples],
        answers=[x.answer for x in examples],
        texts=greedy.texts,
        lengths=greedy.lengths,
        user_inputs=join_user_inputs(greedy.user_inputs),
    )
    pools = {} if own_entries(inputs.cfg) else inputs.reward_pools
    return score_greedy(specs, rows, timeout_s=inputs.cfg.reward.timeout_s, pool=inputs.pool, pools=pools)


@dataclass
class _Completions:
    texts: list[str]  # row i·k + j: completion j of example i (an episode's last model turn)
    lengths: list[int]  # tokens, EOS included (an episode's model tokens)
    tool_calls: list[int]  # per row, 0 without an environment
    # per generation batch, what a user's reward receives (as the training loop builds it)
    user_inputs: list[UserInputs]


def _generate(
    inputs: EvalInputs,
    examples: list[Example],
    *,
    k: int,
    params: SamplingParams,
    progress: EvalProgress | None = None,
    rewarded: bool = False,
) -> _Completions:
    """Completions of `examples`, the evaluation's problems, each seeded by its index; rewarded: with
    what a user's reward receives beside them."""
    cfg, tok = inputs.cfg, inputs.tokenizer
    out = _Completions([], [], [], [])
    size = cfg.eval.batch_size
    for start in range(0, len(examples), size):
        raise_if_stopped()
        batch = examples[start : start + size]
        ids, mask = encode_prompts(tok, cfg.data, batch, inputs.device)
        seeds = [group_seed(cfg.trainer.seed, _EVAL_STEP, start + i) for i in range(len(batch))]
        if inputs.environment is None:
            rollout = inputs.engine.generate(ids, mask, group_size=k, params=params, seeds=seeds)
            out.texts += tok.batch_decode(rollout.completion_ids, skip_special_tokens=True)
            out.tool_calls += [0] * rollout.completion_ids.size(0)
        else:
            episodes = run_episodes(
                inputs.engine,
                inputs.environment,
                ChatTurns(tok, tok.eos_token_id),
                batch,
                ids,
                mask,
                group_size=k,
                params=params,
                seeds=seeds,
                limits=cfg.env,
                eos_id=tok.eos_token_id,
                pad_id=tok.pad_token_id,
            )
            rollout = episodes.rollout
            out.texts += episodes.final_answers
            out.tool_calls += [e.tool_calls for e in episodes.episodes]
        lengths = rollout.completion_lengths.tolist()
        out.lengths += lengths
        if rewarded:
            out.user_inputs.append(user_inputs(batch, rollout, k, lengths, inputs.step or 0))
        if progress is not None:
            what = "greedy" if params.greedy else f"sampled (k={k})"
            progress.batch_done(what, start + len(batch), len(examples), len(lengths))
    return out


def correctness(
    inputs: EvalInputs, examples: list[Example], texts: list[str], *, k: int
) -> list[float | None]:
    """1/0 per completion under the math reward (None: the gold cannot be parsed); under code_exec (all
    tests pass) when the training reward runs code; under reasoning-gym's checker (full marks only) when
    the training reward is reasoning_gym."""
    spec = RewardSpec(
        RewardName.MATH_VERIFIER, 1.0, {"fallback_last_number": inputs.cfg.data.fallback_last_number}
    )
    names = [fn.name for fn in inputs.cfg.reward.functions]
    code = [fn for fn in inputs.cfg.reward.functions if fn.name == RewardName.CODE_EXEC.value]
    if code:
        spec = RewardSpec(RewardName.CODE_EXEC, 1.0, {**code[0].kwargs, "fraction": False})
    if RewardName.REASONING_GYM.value in names:
        spec = RewardSpec(
            RewardName.REASONING_GYM, 1.0, {"fallback_last_number": inputs.cfg.data.fallback_last_number}
        )
    rows = [x for x in examples for _ in range(k)]
    questions = [x.question for x in rows]
    columns = {name: [x.columns.get(name) for x in rows] for name in ("question", "answer", "metadata")}
    result = score(
        [spec],
        questions,
        texts,
        [x.answer for x in rows],
        timeout_s=inputs.cfg.reward.timeout_s,
        pool=inputs.pool,
        user_inputs=UserInputs(prompts=questions, columns=columns),
    )
    return [None if v is None else float(v >= 1.0) for v in result.total]


def is_due(e: EvalConfig, step: int, max_steps: int) -> bool:
    """Evaluate at step 0, every `every_steps` steps and after the last step (0: never)."""
    return e.every_steps > 0 and (step % e.every_steps == 0 or step == max_steps)


def due_steps(e: EvalConfig, start: int, max_steps: int) -> list[int]:
    """The steps whose weights a run resumed after step `start` (0: a fresh run) evaluates."""
    return [s for s in range(start, max_steps + 1) if is_due(e, s, max_steps) and (s > start or s == 0)]


# name -> (the config to prompt and score the set with, its examples)
HeldOutSets = dict[str, tuple[Config, list[Example]]]


def held_out_sets(cfg: Config, default: list[Example], extra: dict[str, list[Example]]) -> HeldOutSets:
    """Every held-out set of a run: data's split (DEFAULT_SET), then eval.datasets."""
    sets = {DEFAULT_SET: (cfg, default)}
    for name, data in cfg.eval.datasets.items():
        sets[name] = (replace(cfg, data=data), extra[name])
    return sets


@dataclass
class SetResult:
    """One held-out set's evaluation, or a share of its problems: what its eval/* are computed from."""

    scores: ProblemScores
    tool_calls: list[int]  # per greedy episode, 0s without an environment
    seconds: float


def summarize_sets(
    sets: HeldOutSets, results: dict[str, SetResult], *, tools: bool
) -> tuple[dict[str, float], dict[str, ProblemScores]]:
    """eval/* of every held-out set (eval/<name>/... for eval.datasets) and their per-problem results, in
    the sets' order; perf/eval_s: their seconds summed."""
    values: dict[str, float] = {M.EVAL_S: 0.0}
    problems: dict[str, ProblemScores] = {}
    for name in sets:
        result = results[name]
        problems[name] = result.scores
        dataset = None if name == DEFAULT_SET else name
        values.update(summarize(result.scores, dataset))
        values.update(tool_call_rate(tools, result.tool_calls, dataset))
        values[M.EVAL_S] += result.seconds
    return values, problems


def evaluate_sets(sets: HeldOutSets, base: EvalInputs) -> tuple[dict[str, float], dict]:
    """eval/* of every held-out set (eval/<name>/... for eval.datasets) and their per-problem results;
    `base`: the engine, the pool and the settings every set shares (its cfg and examples are replaced by
    each set's)."""
    results: dict[str, SetResult] = {}
    for name, (cfg, examples) in sets.items():
        inputs = replace(base, cfg=cfg, examples=examples, name=name)
        scores, seconds, calls = evaluate_problems(inputs)
        results[name] = SetResult(scores, calls, seconds)
    return summarize_sets(sets, results, tools=base.environment is not None)


def evaluate_run(ctx, step: int | None = None) -> dict[str, float]:
    """eval/* of the run's current policy on its held-out sets, sampled by the run's own engine; the
    per-problem results of step `step` go to the run dir, for the final paired comparison."""
    sets = held_out_sets(ctx.cfg, ctx.eval_examples, ctx.extra_eval_sets)
    base = EvalInputs(
        ctx.cfg,
        ctx.tokenizer,
        ctx.eval_examples,
        ctx.rewards.pool,
        ctx.device,
        ctx.generation,
        ctx.environment,
        step=step or 0,
        progress=ctx.engine.is_main,  # only the main rank prints
        reward_pools=ctx.rewards.pools,
    )
    values, problems = evaluate_sets(sets, base)
    if step is not None and ctx.engine.is_main:
        write_problems(ctx.cfg.run_dir, step, problems)
    return values


def logged_evals(run_dir: str, upto: int) -> dict[int, dict[str, float]]:
    """The evaluations already in the run's metrics.jsonl up to step `upto`: a resumed run's final summary
    still compares against its step-0 evaluation, which ran in the first process."""
    path = Path(run_dir) / "metrics.jsonl"
    history: dict[int, dict[str, float]] = {}
    if not path.exists():
        return history
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # a torn last line from a kill mid-write
            continue
        if M.EVAL_S in row and row["step"] <= upto:  # an evaluation's row (some have no eval/accuracy)
            history[row["step"]] = {k: v for k, v in row.items() if k.startswith("eval/") or k == M.EVAL_S}
    return history
