"""A single-process run does not import DeepSpeed.

transformers' `save_pretrained` unwraps the model through accelerate's `extract_model_from_parallel`,
which imports deepspeed whenever the package is installed, only to add `DeepSpeedEngine` to the wrapper
types it checks with isinstance. A single-process run never wraps its model in one, yet that import
costs every run a second and DeepSpeed's "Setting accelerator to CPU" warning. So such a run tells
accelerate's unwrap that DeepSpeed is absent; `distributed=zero2` runs (the only ones that use it) keep it.
"""


def keep_deepspeed_unimported() -> None:
    """Call once in a process that will never build a DeepSpeed engine."""
    try:
        import accelerate.utils.other as accelerate_other
    except ImportError:  # without accelerate, transformers unwraps by `.module` and never imports deepspeed
        return
    accelerate_other.is_deepspeed_available = lambda: False
