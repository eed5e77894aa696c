"""Everything a run holds, built once from the typed config: models, engine, data, rewards, tracker."""

import atexit
import contextlib
import random
import resource
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from grpo_run import checkpoint
from grpo_run.config.run_dir import give_up_claim
from grpo_run.config.schema import Config, DataConfig, DistributedKind
from grpo_run.data import DataSource, Example, PromptSampler, load_split
from grpo_run.engine import Engine, SingleProcessEngine
from grpo_run.engine.schedule import lr_factor
from grpo_run.models.loading import load_model, load_tokenizer, resolve_model_path
from grpo_run.models.sampling_copy import SamplingWeights, wants_bf16_copy
from grpo_run.rewards.scoring import RewardPool, RewardSpec, ScoreResult, score
from grpo_run.tracking import ConsoleSink, JsonlSink, Sink, Tracker, console
from grpo_run.tracking.wandb_run import WandbSink


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


def chat_prompts(tokenizer: PreTrainedTokenizerBase, data: DataConfig, questions: list[str]) -> list[str]:
    """Chat-formatted prompts ending with the assistant turn's opening (training and evaluation alike)."""
    out = []
    for q in questions:
        messages = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
        messages.append({"role": "user", "content": data.prompt_template.replace("{question}", q)})
        out.append(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
    return out


@dataclass
class RunContext:
    cfg: Config
    device: torch.device
    tokenizer: PreTrainedTokenizerBase
    policy: PreTrainedModel
    sampling: SamplingWeights  # what generation and evaluation run: the policy or its bf16 copy
    reference: PreTrainedModel | None
    engine: Engine
    sampler: PromptSampler
    eval_examples: list[Example]
    tracker: Tracker
    reward_pool: RewardPool
    reward_min: float
    reward_max: float
    start_step: int = 0
    # The KL coefficient of the next step: cfg.grpo.beta, then steered by kl_control=adaptive (checkpointed).
    beta: float = 0.0
    # Optimizer updates skipped in a row for a non-finite loss or gradient (checkpointed).
    nonfinite_streak: int = 0
    _reported_error: bool = False
    _closers: list[Callable[[], None]] = field(default_factory=list)

    def autocast(self):
        if not self.cfg.model.autocast_bf16:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=torch.bfloat16)

    def format_prompts(self, questions: list[str]) -> list[str]:
        return chat_prompts(self.tokenizer, self.cfg.data, questions)

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


def join_ranks(cfg: Config, device: torch.device) -> tuple[Config, torch.device]:
    """DeepSpeed: join the process group first; each GPU rank then trains on its own device, and every
    rank writes to rank 0's run dir (a rank's own, claimed before it knew rank 0's, is removed)."""
    if cfg.distributed.kind != DistributedKind.DEEPSPEED:
        return cfg, device
    from grpo_run.engine.launch import init_process_group, rank0_run_dir, shutdown

    layout = init_process_group(device.type, cfg.distributed.master_addr, cfg.distributed.master_port)
    atexit.register(shutdown)
    shared = rank0_run_dir(cfg.run_dir)
    if shared != cfg.run_dir:
        give_up_claim(cfg.run_dir)
        cfg = replace(cfg, run_dir=shared)
    return cfg, torch.device("cuda", layout.local_rank) if device.type == "cuda" else device


def single_engine(cfg: Config, policy: PreTrainedModel, device: torch.device) -> Engine:
    t = cfg.trainer
    return SingleProcessEngine(
        policy,
        lr=t.lr,
        weight_decay=t.weight_decay,
        betas=(t.adam_beta1, t.adam_beta2),
        lr_factor=lr_factor(t.lr_scheduler, warmup_steps=t.warmup_steps, max_steps=t.max_steps),
        max_grad_norm=t.max_grad_norm,
        device=device,
        fused_adamw=t.fused_adamw,
    )


def deepspeed_engine(cfg: Config, policy: PreTrainedModel, device: torch.device) -> Engine:
    from grpo_run.engine.deepspeed_engine import DeepSpeedEngine, deepspeed_config, resolve_bf16

    t, d = cfg.trainer, cfg.distributed
    ds_config = deepspeed_config(
        zero_stage=d.zero_stage,
        offload_optimizer=d.offload_optimizer,
        bf16=resolve_bf16(d.bf16, device),
        micro_batch_size=t.micro_batch_size,
        completions_per_step=t.prompts_per_step * cfg.grpo.group_size,
        world_size=d.nproc_per_node * d.nnodes,
        max_grad_norm=t.max_grad_norm,
    )
    return DeepSpeedEngine(
        policy,
        lr=t.lr,
        weight_decay=t.weight_decay,
        betas=(t.adam_beta1, t.adam_beta2),
        lr_factor=lr_factor(t.lr_scheduler, warmup_steps=t.warmup_steps, max_steps=t.max_steps),
        ds_config=ds_config,
        device=device,
        fused_adamw=t.fused_adamw,
    )


ENGINES: dict[DistributedKind, Callable[[Config, PreTrainedModel, torch.device], Engine]] = {
    DistributedKind.SINGLE: single_engine,
    DistributedKind.DEEPSPEED: deepspeed_engine,
}


def build_context(cfg: Config) -> RunContext:
    seed_everything(cfg.trainer.seed)
    # A built-in model's cached folder is made before the ranks join: once torch.distributed is
    # initialised, transformers' save_pretrained writes weights on rank 0 only.
    resolve_model_path(cfg.model)
    cfg, device = join_ranks(cfg, resolve_device(cfg.trainer.device))
    train_examples, eval_examples = load_data(cfg)  # bad data fails before any model loads
    resume_from = checkpoint.find_resume(cfg.resume, Path(cfg.run_dir))  # so does a bad resume path
    first_step = checkpoint.read_state(resume_from).step if resume_from else 0
    tokenizer = load_tokenizer(cfg.model)
    policy = load_model(cfg.model, device, trainable=True)
    sampling = SamplingWeights(
        policy,
        bf16_copy=wants_bf16_copy(
            autocast_bf16=cfg.model.autocast_bf16,
            weight_dtype=next(policy.parameters()).dtype,
            enabled=cfg.generation.bf16_sampling_copy,
        ),
    )
    # beta = 0: the KL term vanishes, so no reference model is loaded at all.
    reference = load_model(cfg.model, device, trainable=False) if cfg.grpo.beta > 0 else None
    t = cfg.trainer
    engine = ENGINES[cfg.distributed.kind](cfg, policy, device)
    sampler = PromptSampler(train_examples, seed=cfg.data.seed + t.seed, batch_size=t.prompts_per_step)
    run_dir = Path(cfg.run_dir)
    sinks: list[Sink] = []
    if engine.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        if cfg.resume is not None:
            checkpoint.prepare_run_dir(run_dir, resume_from, first_step)
        if cfg.logger.jsonl:
            sinks.append(JsonlSink(run_dir / "metrics.jsonl"))
        if cfg.logger.wandb:
            sinks.append(WandbSink(cfg))
        if cfg.logger.console and sys.stderr is not None:
            sinks.append(ConsoleSink(t.max_steps, cfg.logger.print_every, first_step))
    lo, hi = reward_bounds(cfg)
    ctx = RunContext(
        cfg=cfg,
        device=device,
        tokenizer=tokenizer,
        policy=policy,
        sampling=sampling,
        reference=reference,
        engine=engine,
        sampler=sampler,
        eval_examples=eval_examples,
        tracker=Tracker(sinks),
        reward_pool=RewardPool(),
        reward_min=lo,
        reward_max=hi,
        beta=cfg.grpo.beta,
    )
    if resume_from is not None:
        try:
            checkpoint.restore(ctx, resume_from)  # last: its RNG states replace those building drew from
        except BaseException:
            ctx.close()
            raise
    return ctx
