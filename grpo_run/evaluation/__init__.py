"""Held-out evaluation: during a run and as `mode=eval` (whose door is grpo_run/eval_mode.py).

held_out.py   greedy pass@1, sampled mean@k / pass@k of the engine's model on the held-out sets
stats.py      per-problem results, rates with 95% intervals, the paired before / after change
report.py     a training run's before / after / change table and eval_summary.json
"""
