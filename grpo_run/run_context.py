"""Everything a run holds, built once from the typed config: models, engine, data, rewards, tracker."""

import contextlib
import random
import resource
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from grpo_run.config.schema import Config
from grpo_run.data import DataSource, Example, PromptSampler, load_split
from grpo_run.engine import Engine, SingleProcessEngine
from grpo_run.models.loading import load_model, load_tokenizer
from grpo_run.rewards.scoring import RewardPool, RewardSpec, ScoreResult, score
from grpo_run.tracking import ConsoleSink, JsonlSink, Sink, Tracker, console


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def peak_memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    # ru_maxrss is in KiB on Linux: the process's peak resident set.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def load_data(cfg: Config) -> tuple[list[Example], list[Example]]:
    d = cfg.data
    options: dict = {}
    if d.source == DataSource.ARITHMETIC:
        options = asdict(d.arithmetic)
    elif d.source == DataSource.JSONL:
        options = {
            "question_field": d.question_field,
            "answer_field": d.answer_field,
            "answer_format": d.answer_format,
            "on_bad_record": d.on_bad_record,
        }
    common = {"seed": d.seed, "train_size": d.train_size, "eval_size": d.eval_size, **options}
    train = load_split(d.source, split="train", train_path=d.train_path, eval_path=d.eval_path, **common)
    evaluation: list[Example] = []
    if d.eval_path is not None or d.source in (DataSource.ARITHMETIC, DataSource.MATH500):
        evaluation = load_split(
            d.source, split="eval", train_path=d.train_path, eval_path=d.eval_path, **common
        )
    return train, evaluation


def reward_range(name: str, kwargs: dict) -> tuple[float, float]:
    """The lowest and highest value one reward function can give."""
    if name == "overlong_penalty":
        return -float(kwargs.get("penalty_factor", 1.0)), 0.0
    return 0.0, 1.0  # math_verifier, format, target_char_fraction


def reward_bounds(cfg: Config) -> tuple[float, float]:
    """The weighted total's lowest and highest possible values (for frac_all_correct/wrong)."""
    lo = hi = 0.0
    for fn in cfg.reward.functions:
        a, b = (fn.weight * x for x in reward_range(fn.name, fn.kwargs))
        lo, hi = lo + min(a, b), hi + max(a, b)
    return lo, hi


@dataclass
class RunContext:
    cfg: Config
    device: torch.device
    tokenizer: PreTrainedTokenizerBase
    policy: PreTrainedModel
    reference: PreTrainedModel | None
    engine: Engine
    sampler: PromptSampler
    eval_examples: list[Example]
    tracker: Tracker
    reward_pool: RewardPool
    reward_min: float
    reward_max: float
    start_step: int = 0
    _reported_error: bool = False
    _closers: list[Callable[[], None]] = field(default_factory=list)

    def autocast(self):
        if not self.cfg.model.autocast_bf16:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=torch.bfloat16)

    def format_prompts(self, questions: list[str]) -> list[str]:
        """Chat-formatted prompts ending with the assistant turn's opening."""
        d = self.cfg.data
        out = []
        for q in questions:
            messages = [{"role": "system", "content": d.system_prompt}] if d.system_prompt else []
            messages.append({"role": "user", "content": d.prompt_template.replace("{question}", q)})
            out.append(
                self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            )
        return out

    def score(self, prompts, completions, answers, completion_lengths) -> ScoreResult:
        specs = [RewardSpec(fn.name, fn.weight, dict(fn.kwargs)) for fn in self.cfg.reward.functions]
        return score(
            specs,
            prompts,
            completions,
            answers,
            timeout_s=self.cfg.reward.timeout_s,
            pool=self.reward_pool,
            batch_kwargs={"completion_lengths": completion_lengths},
        )

    def report_reward_errors(self, scores: ScoreResult) -> None:
        """Log the first reward traceback of the run once; later ones are only counted."""
        if scores.first_error and not self._reported_error and self.engine.is_main:
            self._reported_error = True
            console.print(
                f"[yellow]a reward function raised (scored 0, counted in train/reward_errors):\n{scores.first_error}"
            )

    def close(self) -> None:
        self.tracker.close()
        self.reward_pool.close()
        for closer in self._closers:
            closer()


def build_context(cfg: Config) -> RunContext:
    seed_everything(cfg.trainer.seed)
    device = resolve_device(cfg.trainer.device)
    train_examples, eval_examples = load_data(cfg)  # bad data fails before any model loads
    tokenizer = load_tokenizer(cfg.model)
    policy = load_model(cfg.model, device, trainable=True)
    # beta = 0: the KL term vanishes, so no reference model is loaded at all.
    reference = load_model(cfg.model, device, trainable=False) if cfg.grpo.beta > 0 else None
    t = cfg.trainer
    engine = SingleProcessEngine(
        policy,
        lr=t.lr,
        weight_decay=t.weight_decay,
        betas=(t.adam_beta1, t.adam_beta2),
        warmup_steps=t.warmup_steps,
        max_grad_norm=t.max_grad_norm,
        device=device,
    )
    sampler = PromptSampler(train_examples, seed=cfg.data.seed + t.seed, batch_size=t.prompts_per_step)
    run_dir = Path(cfg.run_dir)
    sinks: list[Sink] = []
    if engine.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        if cfg.logger.jsonl:
            sinks.append(JsonlSink(run_dir / "metrics.jsonl"))
        if cfg.logger.console and sys.stderr is not None:
            sinks.append(ConsoleSink(t.max_steps, cfg.logger.print_every))
    lo, hi = reward_bounds(cfg)
    return RunContext(
        cfg=cfg,
        device=device,
        tokenizer=tokenizer,
        policy=policy,
        reference=reference,
        engine=engine,
        sampler=sampler,
        eval_examples=eval_examples,
        tracker=Tracker(sinks),
        reward_pool=RewardPool(),
        reward_min=lo,
        reward_max=hi,
    )
