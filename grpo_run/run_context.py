"""Everything a run holds, built once from the typed config; each piece is built by the room that owns it."""

import contextlib
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from grpo_run import backend, checkpoint
from grpo_run.config.schema import Config, GenerationEngineKind
from grpo_run.data import Example, PromptSampler
from grpo_run.data.prompts import chat_prompts
from grpo_run.data.splits import load_data, load_eval_split
from grpo_run.engine import Engine
from grpo_run.engine.build import build_engine, join_ranks
from grpo_run.engine.device import resolve_device, seed_everything
from grpo_run.models import lora
from grpo_run.models.forward import TrainingForward
from grpo_run.models.loading import load_model, load_tokenizer, resolve_model_path
from grpo_run.models.lora import LoraPolicy
from grpo_run.resume_policy import check_resume
from grpo_run.rollout.engines import GenerationEngine
from grpo_run.run_checks import fit_data
from grpo_run.scoring.run_scorer import RunScorer, log_sandbox, reward_pool
from grpo_run.tracking import ConsoleSink, JsonlSink, Sink, Tracker, console
from grpo_run.tracking.wandb_run import WandbSink


@dataclass
class RunContext:
    cfg: Config
    device: torch.device
    tokenizer: PreTrainedTokenizerBase
    policy: PreTrainedModel
    reference: PreTrainedModel | None  # loaded only when β > 0
    engine: Engine  # gradients: one process or DeepSpeed ranks
    generation: GenerationEngine  # samples the rollouts and the evaluation's completions
    forward: TrainingForward  # log-probs of the update and of π_old / π_ref
    sampler: PromptSampler
    eval_examples: list[Example]
    tracker: Tracker
    rewards: RunScorer
    start_step: int = 0
    # The KL coefficient of the next step: cfg.grpo.beta, then steered by kl_control=adaptive (checkpointed).
    beta: float = 0.0
    # Optimizer updates skipped in a row for a non-finite loss or gradient (checkpointed).
    nonfinite_streak: int = 0
    # The in-flight alarms (set by the loop) and, on resume, the streaks they continue from (checkpointed).
    alarms: Any = None
    alarm_state: dict = field(default_factory=dict)
    # eval.datasets: name -> held-out examples, each evaluated like eval_examples (eval/<name>/...).
    extra_eval_sets: dict[str, list[Example]] = field(default_factory=dict)
    # lora=default: the PEFT wrapper of `policy` (which is its base model with the adapters inside).
    lora: LoraPolicy | None = None
    _closers: list[Callable[[], None]] = field(default_factory=list)

    def reference_model(self) -> contextlib.AbstractContextManager[PreTrainedModel]:
        """π_ref for the block: the reference model, or with LoRA the policy with its adapter disabled."""
        if self.lora is not None:
            return self.lora.adapter_disabled()
        assert self.reference is not None  # loaded whenever beta > 0
        return contextlib.nullcontext(self.reference)

    def close(self) -> None:
        self.tracker.close()
        self.rewards.close()
        self.generation.close()
        for closer in self._closers:
            closer()


def build_sinks(cfg: Config, first_step: int) -> list[Sink]:
    """The main rank's sinks: metrics.jsonl, W&B, the console."""
    sinks: list[Sink] = []
    if cfg.logger.jsonl:
        sinks.append(JsonlSink(Path(cfg.run_dir) / "metrics.jsonl"))
    if cfg.logger.wandb:
        sinks.append(WandbSink(cfg))
    if cfg.logger.console and sys.stderr is not None:
        sinks.append(ConsoleSink(cfg.trainer.max_steps, cfg.logger.print_every, first_step))
    return sinks


def engine_prompts(cfg: Config, tokenizer, train_examples, eval_examples) -> list[str]:
    """Every formatted prompt a vLLM engine may be asked to continue (its default max_model_len)."""
    if cfg.generation.engine != GenerationEngineKind.VLLM:
        return []
    questions = [e.question for e in train_examples + eval_examples[: cfg.eval.num_prompts]]
    return chat_prompts(tokenizer, cfg.data, questions)


def apply_trainer_state(ctx: RunContext, state: checkpoint.TrainerState, folder: Path) -> None:
    """The restored loop state into the context: where the sampler stands, β, the streaks, the step."""
    try:
        ctx.sampler.load_state_dict(state.sampler)
    except ValueError as err:
        raise checkpoint.CheckpointError(f"{folder}: {err}") from None
    ctx.beta = float(state.beta)
    ctx.nonfinite_streak = state.nonfinite_streak
    ctx.alarm_state = state.alarms
    ctx.start_step = state.step


def build_context(cfg: Config) -> RunContext:
    seed_everything(cfg.trainer.seed)
    # A built-in model's cached folder is made before the ranks join: once torch.distributed is
    # initialised, transformers' save_pretrained writes weights on rank 0 only.
    model_path = resolve_model_path(cfg.model)
    # lora.target_modules against the model's structure on the meta device, before any weights load.
    lora_targets = lora.check_targets(model_path, cfg.lora) if cfg.lora.enabled else None
    cfg, device = join_ranks(cfg, resolve_device(cfg.trainer.device))
    train_examples, eval_examples = load_data(cfg.data)  # bad data fails before any model loads
    extra_eval_sets = {name: load_eval_split(d) for name, d in cfg.eval.datasets.items()}
    resume_from = checkpoint.find_resume(cfg.resume, Path(cfg.run_dir))  # so does a bad resume path
    first_step = checkpoint.read_state(resume_from).step if resume_from else 0
    if resume_from is not None:
        applied = check_resume(cfg, resume_from)  # a changed key is applied or refused, never ignored
        if applied:
            console.print(f"resume: changed keys applied: {', '.join(applied)}", soft_wrap=True, markup=False)
    tokenizer = load_tokenizer(cfg.model)
    # Prompts the model cannot take and too few records fail here, before the model loads.
    train_examples, eval_examples, extra_eval_sets = fit_data(
        cfg, tokenizer, train_examples, eval_examples, extra_eval_sets
    )
    policy = load_model(cfg.model, device, trainable=True)
    adapted = (
        None if lora_targets is None else lora.wrap(policy, cfg.lora, lora_targets, seed=cfg.trainer.seed)
    )
    if adapted is not None:
        policy = adapted.model  # the same model object, its targeted projections now LoRA modules
    # beta = 0: the KL term vanishes, so no reference model is loaded at all; with LoRA the reference
    # is the policy with its adapter disabled (`reference_model`), never a second copy.
    wants_reference = cfg.grpo.beta > 0 and adapted is None
    reference = load_model(cfg.model, device, trainable=False) if wants_reference else None
    engine = build_engine(cfg, policy, device)
    t = cfg.trainer
    sampler = PromptSampler(train_examples, seed=cfg.data.seed + t.seed, batch_size=t.prompts_per_step)
    run_dir = Path(cfg.run_dir)
    sinks: list[Sink] = []
    if engine.is_main:
        if adapted is not None:
            console.print(lora.describe(adapted))
        run_dir.mkdir(parents=True, exist_ok=True)
        if cfg.resume is not None:
            checkpoint.prepare_run_dir(run_dir, resume_from, first_step)
        sinks = build_sinks(cfg, first_step)
    if engine.is_main:
        log_sandbox(cfg.reward)
    ctx = RunContext(
        cfg=cfg,
        device=device,
        tokenizer=tokenizer,
        policy=policy,
        reference=reference,
        engine=engine,
        generation=backend.generation_engine(
            cfg,
            policy,
            tokenizer,
            prompts=engine_prompts(
                cfg,
                tokenizer,
                train_examples,
                eval_examples + [e for s in extra_eval_sets.values() for e in s],
            ),
            rank=engine.rank,
            lora=adapted,
        ),
        forward=backend.training_forward(cfg, device),
        sampler=sampler,
        eval_examples=eval_examples,
        extra_eval_sets=extra_eval_sets,
        tracker=Tracker(sinks),
        rewards=RunScorer(cfg.reward, reward_pool(cfg.reward), report_errors=engine.is_main),
        beta=cfg.grpo.beta,
        lora=adapted,
    )
    if resume_from is not None:
        try:
            # Last: its RNG states replace those building drew from.
            apply_trainer_state(ctx, checkpoint.restore(ctx.engine, cfg, resume_from), resume_from)
            ctx.generation.policy_updated()
        except BaseException:
            ctx.close()
            raise
    return ctx
