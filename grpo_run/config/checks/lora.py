"""lora=default (docs/lora.md); its target modules are checked against the model in `models/lora.py`."""

import math

from grpo_run.config.checks.base import check
from grpo_run.config.schema import Config


def validate_lora(cfg: Config) -> None:
    lo = cfg.lora
    if not lo.enabled:
        return
    check(lo.r >= 1, "lora.r", lo.r, "must be an int >= 1 (the adapters' rank)")
    check(lo.alpha > 0 and math.isfinite(lo.alpha), "lora.alpha", lo.alpha, "must be a finite number > 0")
    check(0 <= lo.dropout < 1, "lora.dropout", lo.dropout, "must lie in [0, 1)")
    check(len(lo.target_modules) > 0, "lora.target_modules", [], "needs at least one module name")
    if lo.lr is not None:
        check(lo.lr > 0 and math.isfinite(lo.lr), "lora.lr", lo.lr, "must be a finite number > 0 (or null)")
