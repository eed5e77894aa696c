"""mode=eval: evaluate a model, or a run's checkpoint, on the held-out sets and print the table."""

from grpo_run.config.schema import Config
from grpo_run.envs.registry import build_environment
from grpo_run.evaluation.held_out import EvalInputs, evaluate_sets, held_out_sets
from grpo_run.evaluation.report import report_evaluated
from grpo_run.evaluation.rewards import check_eval_rewards
from grpo_run.evaluation.stats import write_problems
from grpo_run.run_context import build_eval_context
from grpo_run.tracking import console


def evaluate_only(cfg: Config) -> dict[str, float]:
    """mode=eval: load a model (or a run's checkpoint), evaluate it on the held-out split, print a table."""
    check_eval_rewards(cfg)  # an eval.reward _target_ that does not import: before the model loads
    ev = build_eval_context(cfg)
    try:
        sets = held_out_sets(ev.cfg, ev.eval_examples, ev.extra_eval_sets)
        environment = build_environment(ev.cfg.env)
        base = EvalInputs(
            ev.cfg,
            ev.tokenizer,
            ev.eval_examples,
            ev.pool,
            ev.device,
            ev.generation,
            environment,
            progress=True,
        )
        values, problems = evaluate_sets(sets, base)
    finally:
        ev.close()
    cfg = ev.cfg
    write_problems(cfg.run_dir, 0, problems)
    name = cfg.model.path or cfg.model.kind.value
    console.print(f"[bold]evaluated[/] {name} on data={cfg.data.source.value}", soft_wrap=True)
    report_evaluated(cfg, values, ev.eval_examples, ev.extra_eval_sets)
    return values
