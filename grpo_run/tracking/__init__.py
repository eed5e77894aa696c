"""Where a run's numbers go: the console, metrics.jsonl, W&B (`wandb_run`) and the sweep report (`report`)."""

from grpo_run.tracking.sinks import (
    CompletionsSink,
    ConsoleSink,
    JsonlSink,
    Sink,
    Tracker,
    compact_line,
    console,
)

__all__ = ["CompletionsSink", "ConsoleSink", "JsonlSink", "Sink", "Tracker", "compact_line", "console"]
