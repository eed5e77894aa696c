"""Held-out evaluation: greedy pass@1 (`eval/accuracy`) and sampled mean@k (`eval/mean_at_k`).

Correctness is the math reward alone (`math_verifier`: the extracted final answer checked with
math-verify, with the data config's last-number fallback), whatever the training reward adds, so
that a format bonus never inflates accuracy. The sampled pass draws k completions per prompt at
`eval.temperature`; its noise is seeded by (trainer.seed, prompt index) only, so an evaluation
before and after training samples with the same noise and two evaluations of one model agree.
"""

import json
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from rich.table import Table
from transformers import PreTrainedTokenizerBase

from grpo_run import backend
from grpo_run import metrics as M
from grpo_run.config.schema import Config, EvalConfig, ModelConfig, ModelKind
from grpo_run.data import Example
from grpo_run.data.prompts import encode_prompts
from grpo_run.data.splits import load_data
from grpo_run.engine.device import resolve_device, seed_everything
from grpo_run.models.loading import load_model, load_tokenizer
from grpo_run.rewards import RewardName, RewardPool, RewardSpec, format_reward, score
from grpo_run.rollout.engines import GenerationEngine
from grpo_run.rollout.generate import SamplingParams, group_seed
from grpo_run.tracking import console

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


def evaluate(inputs: EvalInputs) -> dict[str, float]:
    """eval/* metrics of the engine's model on the first `eval.num_prompts` held-out examples."""
    e = inputs.cfg.eval
    examples = inputs.examples[: e.num_prompts]
    if not examples:
        raise ValueError(
            "evaluation needs held-out examples (data.eval_path, or a source with an eval split)"
        )
    t0 = time.perf_counter()
    greedy = _generate(inputs, examples, k=1, params=SamplingParams(e.max_new_tokens, greedy=True))
    sampled = _generate(
        inputs, examples, k=e.samples_per_prompt, params=SamplingParams(e.max_new_tokens, e.temperature)
    )
    greedy_correct = correctness(inputs, examples, greedy.texts, k=1)
    sampled_correct = correctness(inputs, examples, sampled.texts, k=e.samples_per_prompt)
    return {
        M.EVAL_ACCURACY: _mean(greedy_correct),
        M.EVAL_MEAN_AT_K: _mean(sampled_correct),
        M.EVAL_BOXED_FRACTION: _mean(format_reward([], greedy.texts, [])),
        M.EVAL_COMPLETION_LEN: sum(greedy.lengths) / len(greedy.lengths),
        M.EVAL_S: time.perf_counter() - t0,
    }


@dataclass
class _Completions:
    texts: list[str]  # row i·k + j: completion j of example i
    lengths: list[int]  # tokens, EOS included


def _generate(inputs: EvalInputs, examples: list[Example], *, k: int, params: SamplingParams) -> _Completions:
    cfg, tok = inputs.cfg, inputs.tokenizer
    texts: list[str] = []
    lengths: list[int] = []
    size = cfg.eval.batch_size
    for start in range(0, len(examples), size):
        batch = examples[start : start + size]
        ids, mask = encode_prompts(tok, cfg.data, [x.question for x in batch], inputs.device)
        seeds = [group_seed(cfg.trainer.seed, _EVAL_STEP, start + i) for i in range(len(batch))]
        rollout = inputs.engine.generate(ids, mask, group_size=k, params=params, seeds=seeds)
        texts += tok.batch_decode(rollout.completion_ids, skip_special_tokens=True)
        lengths += rollout.completion_lengths.tolist()
    return _Completions(texts, lengths)


def correctness(
    inputs: EvalInputs, examples: list[Example], texts: list[str], *, k: int
) -> list[float | None]:
    """1/0 per completion under the math reward (None: the gold cannot be parsed)."""
    spec = RewardSpec(
        RewardName.MATH_VERIFIER, 1.0, {"fallback_last_number": inputs.cfg.data.fallback_last_number}
    )
    questions = [x.question for x in examples for _ in range(k)]
    answers = [x.answer for x in examples for _ in range(k)]
    result = score([spec], questions, texts, answers, timeout_s=inputs.cfg.reward.timeout_s, pool=inputs.pool)
    return result.total


def _mean(values: list[float | None]) -> float:
    """Mean over the scorable values (an unparseable gold is left out, never counted as wrong)."""
    known = [v for v in values if v is not None]
    return sum(known) / len(known) if known else float("nan")


def is_due(e: EvalConfig, step: int, max_steps: int) -> bool:
    """Evaluate at step 0, every `every_steps` steps and after the last step (0: never)."""
    return e.every_steps > 0 and (step % e.every_steps == 0 or step == max_steps)


_QUALITY = (M.EVAL_ACCURACY, M.EVAL_MEAN_AT_K, M.EVAL_BOXED_FRACTION, M.EVAL_COMPLETION_LEN)


def results_table(title: str, columns: dict[str, dict[str, float]], k: int, n: int) -> Table:
    """One row per eval metric, one column per evaluated model or step."""
    table = Table(title=f"{title} ({n} held-out problems, k = {k})")
    table.add_column("metric")
    for name in columns:
        table.add_column(name, justify="right")
    for key in (*_QUALITY, M.EVAL_S):
        cells = [f"{values[key]:.3f}" if key in values else "-" for values in columns.values()]
        table.add_row(key, *cells)
    return table


def report(run_dir: str, title: str, columns: dict[str, dict[str, float]], *, n: int, k: int) -> None:
    """Print the table and write it to `eval_summary.json` in the run dir."""
    console.print(results_table(title, columns, k, n))
    path = Path(run_dir) / "eval_summary.json"
    path.write_text(json.dumps({"num_prompts": n, "k": k, **columns}, indent=2))


def evaluate_run(ctx) -> dict[str, float]:
    """eval/* of the run's current policy on its held-out split, sampled by the run's own engine."""
    cfg = ctx.cfg
    return evaluate(
        EvalInputs(cfg, ctx.tokenizer, ctx.eval_examples, ctx.rewards.pool, ctx.device, ctx.generation)
    )


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
        if M.EVAL_ACCURACY in row and row["step"] <= upto:
            history[row["step"]] = {k: row[k] for k in (*_QUALITY, M.EVAL_S) if k in row}
    return history


def report_run(ctx, history: dict[int, dict[str, float]]) -> None:
    """The final summary of a run: held-out metrics before and after training, and the change."""
    if not history or not ctx.engine.is_main:
        return
    first, last = min(history), max(history)
    columns = {f"step {first}": history[first]}
    if last != first:
        columns[f"step {last}"] = history[last]
        columns["change"] = {k: history[last][k] - history[first][k] for k in _QUALITY if k in history[last]}
    n = min(ctx.cfg.eval.num_prompts, len(ctx.eval_examples))
    report(ctx.cfg.run_dir, "held-out evaluation", columns, n=n, k=ctx.cfg.eval.samples_per_prompt)


def checkpoint_model(cfg: Config) -> ModelConfig:
    """The model to evaluate: `eval.checkpoint` (a model folder, or a run dir holding final/), else cfg.model."""
    if cfg.eval.checkpoint is None:
        return cfg.model
    folder = Path(cfg.eval.checkpoint).expanduser()
    if not (folder / "config.json").exists() and (folder / "final" / "config.json").exists():
        folder = folder / "final"
    return replace(cfg.model, kind=ModelKind.PRETRAINED, path=str(folder))


def evaluate_only(cfg: Config) -> dict[str, float]:
    """mode=eval: load a model (or a run's checkpoint), evaluate it on the held-out split, print a table."""
    seed_everything(cfg.trainer.seed)
    device = resolve_device(cfg.trainer.device)
    _, examples = load_data(cfg.data)
    model_cfg = checkpoint_model(cfg)
    tokenizer = load_tokenizer(model_cfg)
    # Weights that require grad let autocast keep their bf16 copies for the whole decode loop instead of
    # casting every weight at every token (~1.5x faster generation); nothing here computes a gradient.
    model = load_model(model_cfg, device, trainable=True)
    # The engine a training run samples and evaluates with (the same bf16 rounding of the weights).
    engine = backend.generation_engine(cfg, model, tokenizer, owns_policy=True)
    with RewardPool() as pool:
        values = evaluate(EvalInputs(cfg, tokenizer, examples, pool, device, engine))
    engine.close()
    name = model_cfg.path or model_cfg.kind.value
    console.print(f"[bold]evaluated[/] {name} on data={cfg.data.source.value}", soft_wrap=True)
    n = min(cfg.eval.num_prompts, len(examples))
    report(cfg.run_dir, "held-out evaluation", {"value": values}, n=n, k=cfg.eval.samples_per_prompt)
    return values
