"""The held-out evaluation's tables and `eval_summary.json`: a training run's before / after / change, and
mode=eval's one column. The numbers come from grpo_run/evaluation/held_out.py and grpo_run/evaluation/stats.py."""

import json
from pathlib import Path

from rich.table import Table

from grpo_run import metrics as M
from grpo_run.config.schema import Config
from grpo_run.data import Example
from grpo_run.evaluation.stats import DEFAULT_SET, paired_change, read_problems
from grpo_run.tracking import console

_CORRECTNESS = (M.EVAL_ACCURACY, M.EVAL_MEAN_AT_K, M.EVAL_PASS_AT_K)
_QUALITY = (*_CORRECTNESS, M.EVAL_BOXED_FRACTION, M.EVAL_COMPLETION_LEN)
TITLE = "held-out evaluation"


def _logged(columns: dict[str, dict[str, float]], keys: list[str]) -> list[str]:
    """The keys some column holds."""
    return [k for k in keys if any(k in values for values in columns.values())]


def reward_keys(columns: dict[str, dict[str, float]], dataset: str | None = None) -> list[str]:
    """eval.reward's rows: the total's mean, then each function's (the names the columns hold)."""
    prefix, suffix = M.eval_key(M.EVAL_REWARD_FN_MEAN, dataset).split("{}")
    names = dict.fromkeys(
        k[len(prefix) : -len(suffix)]
        for values in columns.values()
        for k in values
        if k.startswith(prefix) and k.endswith(suffix)
    )
    return [M.eval_key(M.EVAL_REWARD_MEAN, dataset), *(prefix + name + suffix for name in names)]


# eval.group_by's per-value keys, in the order their rows appear.
_BY_VALUE = (M.EVAL_PASS_AT_1_BY, M.EVAL_TOOL_CALL_RATE_BY, M.EVAL_CALLS_PER_EPISODE_BY)


def bucket_keys(columns: dict[str, dict[str, float]], dataset: str | None = None) -> list[str]:
    """eval.group_by's rows: per metric of _BY_VALUE, its key for each value the columns hold."""
    keys: list[str] = []
    for template in _BY_VALUE:
        prefix = M.eval_key(template.format(""), dataset)
        found = {
            k
            for values in columns.values()
            for k in values
            if k.startswith(prefix) and not k.endswith((M.CI_LOW, M.CI_HIGH, M.FLIPS_UP, M.FLIPS_DOWN))
        }
        keys += sorted(found)
    return keys


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
    graded = bool(_logged(columns, [M.eval_key(M.EVAL_ACCURACY, dataset)]))
    passes = f"k = {k}" if graded else "greedy only"
    table = Table(title=f"{title} ({n} held-out problems, {passes}; 95% intervals)")
    table.add_column("metric")
    for name in columns:
        table.add_column(name, justify="right")
    keys = [M.eval_key(q, dataset) for q in _QUALITY]
    keys += _logged(columns, [M.eval_key(M.EVAL_TOOL_CALL_RATE, dataset)])  # an environment's evaluation
    keys += _logged(columns, [M.eval_key(M.EVAL_CALLS_PER_EPISODE, dataset)])
    keys += _logged(columns, reward_keys(columns, dataset))  # eval.reward's
    keys += bucket_keys(columns, dataset)  # eval.group_by's
    if not graded:  # no gold answers: no correctness rows
        keys = [k for k in keys if k not in {M.eval_key(q, dataset) for q in _CORRECTNESS}]
        keys = [k for k in keys if not k.startswith(M.eval_key(M.EVAL_PASS_AT_1_BY.format(""), dataset))]
    for key in keys + ([M.EVAL_S] if dataset is None else []):
        table.add_row(key, *[_cell(values, key) for values in columns.values()])
    if any(M.eval_key(M.EVAL_ACCURACY, dataset) + M.FLIPS_UP in v for v in columns.values()):
        table.caption = "change: paired over the same problems; (+a -b): problems gained and lost"
    elif M.eval_key(M.EVAL_REWARD_MEAN, dataset) + M.CI_LOW in columns.get("change", {}):
        table.caption = "change: paired over the same problems"
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


def of_set(values: dict[str, float], dataset: str | None) -> dict[str, float]:
    """The keys of one held-out set: eval/<dataset>/..., or for data's own split the keys without a set
    name (eval/accuracy, eval/rewards/<function>_mean, perf/eval_s)."""
    if dataset is not None:
        return {k: v for k, v in values.items() if k.startswith(f"eval/{dataset}/")}
    # eval/rewards/<function>_mean and eval.group_by's eval/pass@1/<value>, ...: no set takes their names
    own = (M.EVAL_REWARD_FN_MEAN.split("{}")[0], *(t.format("") for t in _BY_VALUE))
    own += (M.EVAL_NUM_PROBLEMS_BY.format(""),)
    return {k: v for k, v in values.items() if k.count("/") == 1 or k.startswith(own)}


def report_training(
    cfg: Config,
    history: dict[int, dict[str, float]],
    eval_examples: list[Example],
    extra_eval_sets: dict[str, list[Example]],
) -> None:
    """The final summary of a training run (main rank): held-out metrics before and after training, and
    the change. history: step -> eval/* as logged."""
    if not history:
        return
    first, last = min(history), max(history)
    before, after = read_problems(cfg.run_dir, first), read_problems(cfg.run_dir, last)
    columns: dict[str, dict[str, dict[str, float]]] = {}
    for name in [DEFAULT_SET, *cfg.eval.datasets]:
        dataset = None if name == DEFAULT_SET else name
        keys = [M.eval_key(q, dataset) for q in _QUALITY] + reward_keys({"": history[first]}, dataset)
        keys += [M.eval_key(M.EVAL_TOOL_CALL_RATE, dataset), M.eval_key(M.EVAL_CALLS_PER_EPISODE, dataset)]
        keys += bucket_keys({"": history[first]}, dataset)
        set_columns = {f"step {first}": of_set(history[first], dataset)}
        if last != first:
            set_columns[f"step {last}"] = of_set(history[last], dataset)
            change = {
                k: history[last][k] - history[first][k]
                for k in keys
                if k in history[last] and k in history[first]
            }
            if name in before and name in after:  # an evaluation from before per-problem files: no pairing
                change.update(paired_change(before[name], after[name], dataset))
            set_columns["change"] = change
        columns[name] = set_columns
    n = min(cfg.eval.num_prompts, len(eval_examples))
    extra = {
        name: (columns[name], min(cfg.eval.num_prompts, len(examples)))
        for name, examples in extra_eval_sets.items()
    }
    k = cfg.eval.samples_per_prompt
    report(cfg.run_dir, TITLE, columns[DEFAULT_SET], n=n, k=k, datasets=extra)


def report_evaluated(
    cfg: Config,
    values: dict[str, float],
    eval_examples: list[Example],
    extra_eval_sets: dict[str, list[Example]],
) -> None:
    """mode=eval's tables: one column, the evaluated model's."""
    n = min(cfg.eval.num_prompts, len(eval_examples))
    sets = {
        name: ({"value": of_set(values, name)}, min(cfg.eval.num_prompts, len(examples)))
        for name, examples in extra_eval_sets.items()
    }
    report(
        cfg.run_dir, TITLE, {"value": of_set(values, None)}, n=n, k=cfg.eval.samples_per_prompt, datasets=sets
    )
