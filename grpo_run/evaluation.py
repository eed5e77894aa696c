"""Held-out evaluation: greedy pass@1 (`eval/accuracy`), sampled mean@k and pass@k, each with a 95%
interval over problems (grpo_run/eval_stats.py), on data's held-out split and every `eval.datasets` set.

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
from grpo_run.config.saved_run import checkpoint_model_settings
from grpo_run.config.schema import Config, EvalConfig, ModelConfig
from grpo_run.data import Example
from grpo_run.data.prompts import chat_prompts, encode_prompts
from grpo_run.data.splits import load_data, load_eval_split
from grpo_run.engine.device import resolve_device, seed_everything
from grpo_run.eval_stats import (
    DEFAULT_SET,
    ProblemScores,
    paired_change,
    read_problems,
    summarize,
    write_problems,
)
from grpo_run.models import lora
from grpo_run.models.loading import load_model, load_tokenizer
from grpo_run.rewards import RewardName, format_reward
from grpo_run.rollout.engines import GenerationEngine
from grpo_run.rollout.generate import SamplingParams, group_seed
from grpo_run.run_checks import fit_data
from grpo_run.scoring import RewardPool, RewardSpec, score
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
    scores, seconds = evaluate_problems(inputs)
    return {**summarize(scores), M.EVAL_S: seconds}


def evaluate_problems(inputs: EvalInputs) -> tuple[ProblemScores, float]:
    """Problem by problem: greedy and sampled correctness of the engine's model, and the seconds it took."""
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
    scores = ProblemScores.from_rows(
        [x.id for x in examples],
        greedy_correct,
        sampled_correct,
        format_reward([], greedy.texts, []),
        greedy.lengths,
        k=e.samples_per_prompt,
    )
    return scores, time.perf_counter() - t0


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
    """1/0 per completion under the math reward (None: the gold cannot be parsed); under code_exec (all
    tests pass) when the training reward runs code."""
    spec = RewardSpec(
        RewardName.MATH_VERIFIER, 1.0, {"fallback_last_number": inputs.cfg.data.fallback_last_number}
    )
    code = [fn for fn in inputs.cfg.reward.functions if fn.name == RewardName.CODE_EXEC.value]
    if code:
        spec = RewardSpec(RewardName.CODE_EXEC, 1.0, {**code[0].kwargs, "fraction": False})
    questions = [x.question for x in examples for _ in range(k)]
    answers = [x.answer for x in examples for _ in range(k)]
    result = score([spec], questions, texts, answers, timeout_s=inputs.cfg.reward.timeout_s, pool=inputs.pool)
    return result.total


def is_due(e: EvalConfig, step: int, max_steps: int) -> bool:
    """Evaluate at step 0, every `every_steps` steps and after the last step (0: never)."""
    return e.every_steps > 0 and (step % e.every_steps == 0 or step == max_steps)


_QUALITY = (M.EVAL_ACCURACY, M.EVAL_MEAN_AT_K, M.EVAL_PASS_AT_K, M.EVAL_BOXED_FRACTION, M.EVAL_COMPLETION_LEN)


def _cell(values: dict[str, float], key: str) -> str:
    """`value [low, high]`, and the flips `+up -down` where the column has them (the change)."""
    if key not in values:
        return "-"
    text = f"{values[key]:.3f}"
    if key + M.CI_LOW in values:
        text += f" [{values[key + M.CI_LOW]:.3f}, {values[key + M.CI_HIGH]:.3f}]"
    if key + M.FLIPS_UP in values:
        text += f" (+{values[key + M.FLIPS_UP]:.0f} -{values[key + M.FLIPS_DOWN]:.0f})"
    return text


def results_table(
    title: str, columns: dict[str, dict[str, float]], k: int, n: int, dataset: str | None = None
) -> Table:
    """One row per eval metric, one column per evaluated model or step; rates with their 95% interval."""
    table = Table(title=f"{title} ({n} held-out problems, k = {k}; 95% intervals)")
    table.add_column("metric")
    for name in columns:
        table.add_column(name, justify="right")
    for key in [M.eval_key(q, dataset) for q in _QUALITY] + ([M.EVAL_S] if dataset is None else []):
        table.add_row(key, *[_cell(values, key) for values in columns.values()])
    if any(M.eval_key(M.EVAL_ACCURACY, dataset) + M.FLIPS_UP in v for v in columns.values()):
        table.caption = "change: paired over the same problems; (+a -b): problems gained and lost"
    return table


def report(
    run_dir: str,
    title: str,
    columns: dict[str, dict[str, float]],
    *,
    n: int,
    k: int,
    datasets: dict[str, tuple[dict[str, dict[str, float]], int]] | None = None,
) -> None:
    """Print the tables and write them to `eval_summary.json` in the run dir (eval.datasets under
    "datasets": name -> its columns and num_prompts)."""
    console.print(results_table(title, columns, k, n))
    summary: dict = {"num_prompts": n, "k": k, **columns}
    for name, (set_columns, set_n) in (datasets or {}).items():
        console.print(results_table(f"{title}: {name}", set_columns, k, set_n, dataset=name))
        summary.setdefault("datasets", {})[name] = {"num_prompts": set_n, **set_columns}
    path = Path(run_dir) / "eval_summary.json"
    path.write_text(json.dumps(summary, indent=2))


def _held_out_sets(cfg: Config, default: list[Example], extra: dict[str, list[Example]]):
    """name -> (the config to prompt and score it with, its examples): data's split, then eval.datasets."""
    sets = {DEFAULT_SET: (cfg, default)}
    for name, data in cfg.eval.datasets.items():
        sets[name] = (replace(cfg, data=data), extra[name])
    return sets


def evaluate_sets(sets, tokenizer, pool, device, engine: GenerationEngine) -> tuple[dict[str, float], dict]:
    """eval/* of every held-out set (eval/<name>/... for eval.datasets) and their per-problem results."""
    values: dict[str, float] = {M.EVAL_S: 0.0}
    problems: dict[str, ProblemScores] = {}
    for name, (cfg, examples) in sets.items():
        scores, seconds = evaluate_problems(EvalInputs(cfg, tokenizer, examples, pool, device, engine))
        problems[name] = scores
        values.update(summarize(scores, None if name == DEFAULT_SET else name))
        values[M.EVAL_S] += seconds
    return values, problems


def evaluate_run(ctx, step: int | None = None) -> dict[str, float]:
    """eval/* of the run's current policy on its held-out sets, sampled by the run's own engine; the
    per-problem results of step `step` go to the run dir, for the final paired comparison."""
    sets = _held_out_sets(ctx.cfg, ctx.eval_examples, ctx.extra_eval_sets)
    values, problems = evaluate_sets(sets, ctx.tokenizer, ctx.rewards.pool, ctx.device, ctx.generation)
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
        if M.EVAL_ACCURACY in row and row["step"] <= upto:
            history[row["step"]] = {k: v for k, v in row.items() if k.startswith("eval/") or k == M.EVAL_S}
    return history


def report_run(ctx, history: dict[int, dict[str, float]]) -> None:
    """The final summary of a run: held-out metrics before and after training, and the change."""
    if not history or not ctx.engine.is_main:
        return
    first, last = min(history), max(history)
    before, after = read_problems(ctx.cfg.run_dir, first), read_problems(ctx.cfg.run_dir, last)
    columns: dict[str, dict[str, dict[str, float]]] = {}
    for name in _held_out_sets(ctx.cfg, ctx.eval_examples, ctx.extra_eval_sets):
        dataset = None if name == DEFAULT_SET else name
        keys = [M.eval_key(q, dataset) for q in _QUALITY]
        set_columns = {f"step {first}": _of_set(history[first], dataset)}
        if last != first:
            set_columns[f"step {last}"] = _of_set(history[last], dataset)
            change = {
                k: history[last][k] - history[first][k]
                for k in keys
                if k in history[last] and k in history[first]
            }
            if name in before and name in after:  # an evaluation from before per-problem files: no pairing
                change.update(paired_change(before[name], after[name], dataset))
            set_columns["change"] = change
        columns[name] = set_columns
    cfg = ctx.cfg
    n = min(cfg.eval.num_prompts, len(ctx.eval_examples))
    extra = {
        name: (columns[name], min(cfg.eval.num_prompts, len(examples)))
        for name, examples in ctx.extra_eval_sets.items()
    }
    k = cfg.eval.samples_per_prompt
    report(cfg.run_dir, "held-out evaluation", columns[DEFAULT_SET], n=n, k=k, datasets=extra)


def _of_set(values: dict[str, float], dataset: str | None) -> dict[str, float]:
    """The keys of one held-out set: eval/<dataset>/..., or for data's own split the keys without a set
    name (eval/accuracy, perf/eval_s)."""
    if dataset is not None:
        return {k: v for k, v in values.items() if k.startswith(f"eval/{dataset}/")}
    return {k: v for k, v in values.items() if k.count("/") == 1}


def checkpoint_model(cfg: Config) -> ModelConfig:
    """The model to evaluate: `eval.checkpoint` (a model folder, or a run dir holding final/), else cfg.model.

    A run's checkpoint loads with that run's own model settings unless the command line sets them."""
    if cfg.eval.checkpoint is None:
        return cfg.model
    folder = Path(cfg.eval.checkpoint).expanduser()
    if not (folder / "config.json").exists() and (folder / "final" / "config.json").exists():
        folder = folder / "final"
    model, settings = checkpoint_model_settings(folder, cfg.model, cfg.run_dir)
    console.print(settings, soft_wrap=True)
    return model


def evaluate_only(cfg: Config) -> dict[str, float]:
    """mode=eval: load a model (or a run's checkpoint), evaluate it on the held-out split, print a table."""
    seed_everything(cfg.trainer.seed)
    device = resolve_device(cfg.trainer.device)
    _, examples = load_data(cfg.data)
    extra = {name: load_eval_split(d) for name, d in cfg.eval.datasets.items()}
    model_cfg = checkpoint_model(cfg)
    adapter = lora.adapter_folder(cfg.eval.checkpoint)  # a LoRA run: its base model plus final/'s adapter
    if adapter is not None:
        model_cfg = lora.base_model_config(model_cfg, adapter)  # the run's model settings, its base weights
    cfg = replace(cfg, model=model_cfg)  # the engine's autocast and bf16 copy follow the model evaluated
    tokenizer = load_tokenizer(model_cfg)
    # Prompts the evaluated model cannot take fail (or are skipped) here, before it loads.
    _, examples, extra = fit_data(cfg, tokenizer, None, examples, extra, model=model_cfg)
    # Weights that require grad let autocast keep their bf16 copies for the whole decode loop instead of
    # casting every weight at every token (~1.5x faster generation); nothing here computes a gradient.
    model = load_model(model_cfg, device, trainable=True)
    if adapter is not None:
        model = lora.merged_with_adapter(model, adapter).requires_grad_(True)
    # The engine a training run samples and evaluates with (the same bf16 rounding of the weights).
    held_out = examples[: cfg.eval.num_prompts] + [x for s in extra.values() for x in s]
    prompts = chat_prompts(tokenizer, cfg.data, [x.question for x in held_out])
    engine = backend.generation_engine(
        cfg, model, tokenizer, owns_policy=True, model_cfg=model_cfg, prompts=prompts
    )
    with RewardPool(max_workers=cfg.reward.workers) as pool:
        values, problems = evaluate_sets(
            _held_out_sets(cfg, examples, extra), tokenizer, pool, device, engine
        )
    engine.close()
    write_problems(cfg.run_dir, 0, problems)
    name = model_cfg.path or model_cfg.kind.value
    console.print(f"[bold]evaluated[/] {name} on data={cfg.data.source.value}", soft_wrap=True)
    n = min(cfg.eval.num_prompts, len(examples))
    sets = {
        set_name: ({"value": _of_set(values, set_name)}, min(cfg.eval.num_prompts, len(set_examples)))
        for set_name, set_examples in extra.items()
    }
    report(
        cfg.run_dir,
        "held-out evaluation",
        {"value": _of_set(values, None)},
        n=n,
        k=cfg.eval.samples_per_prompt,
        datasets=sets,
    )
    return values
