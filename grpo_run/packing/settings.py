"""`trainer.padding_free` and `trainer.micro_batch_tokens` → the training forward's `PackingState`, and
the run's start line that says whether packing is on and why."""

from grpo_run.config.schema import Config, DistributedKind, KernelChoice
from grpo_run.packing.check import PackingState


def ranks(cfg: Config) -> int:
    d = cfg.distributed
    return d.nproc_per_node * d.nnodes if d.kind == DistributedKind.DEEPSPEED else 1


def resolved(cfg: Config) -> tuple[bool, str]:
    """(on, why) for this run. null (the default) packs where it is exact and measured faster: one rank, the
    native forward (docs/performance.md, "Packed micro-batches": faster on spread lengths, no slower on
    equal ones). Off on several ranks (each rank's micro-batch count must match), with an entropy quantile
    (grpo.top_entropy_quantile < 1 keeps the top tokens of each micro-batch, so the loss would depend on
    which rows the budget puts together) and on transformers' forward, whose mask for a packed row without
    flash-attention is quadratic in the whole row, not in each sequence; `true` asks for it anyway on one
    rank, `false` pads."""
    t = cfg.trainer
    if t.padding_free is not None:
        return t.padding_free, "trainer.padding_free=" + str(t.padding_free).lower()
    if ranks(cfg) > 1:
        return False, "auto: off on several ranks"
    if cfg.grpo.top_entropy_quantile < 1.0:
        return False, "auto: off with grpo.top_entropy_quantile < 1 (its quantile is per micro-batch)"
    if cfg.backend.forward == KernelChoice.HF:
        return False, "auto: off under backend.forward=hf (no per-sequence attention without flash-attn)"
    return True, "auto: one rank, native forward"


def packing_state(cfg: Config) -> PackingState | None:
    """The training forward's packing, or None when the run pads its micro-batches."""
    on, _ = resolved(cfg)
    if not on:
        return None
    return PackingState(
        budget=cfg.trainer.micro_batch_tokens,
        share_prompts=cfg.backend.forward != KernelChoice.HF and cfg.backend.shared_prompt_forward,
    )


def packing_line(cfg: Config) -> str:
    """The run's start line about packing."""
    on, why = resolved(cfg)
    if not on:
        return f"padding_free: off ({why}): micro-batches of trainer.micro_batch_size rows, padded"
    budget = cfg.trainer.micro_batch_tokens
    size = f"{budget} token-equivalents" if budget else f"{cfg.trainer.micro_batch_size} x the longest row"
    return f"padding_free: on ({why}): packed micro-batches of up to {size}, checked on the first step"
