"""Everything a run holds, built once from the typed config; each piece is built by the room that owns it."""

import contextlib
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from grpo_run import backend, checkpoint
from grpo_run.algo import LossSettings
from grpo_run.config.checks.distill import check_teacher_context
from grpo_run.config.checks.evaluation import validate_group_by
from grpo_run.config.checks.reward import validate_gold_answers
from grpo_run.config.convert import precision_note
from grpo_run.config.saved_run import checkpoint_model_settings
from grpo_run.config.schema import Config, DistillKind, ModelConfig, RolloutMode
from grpo_run.data import Example, PromptSampler
from grpo_run.data.prompts import teacher_messages
from grpo_run.data.splits import evaluation_on, load_data, load_eval_split
from grpo_run.engine import Engine
from grpo_run.engine.build import build_engine, join_ranks
from grpo_run.engine.device import resolve_autocast_bf16, resolve_device, seed_everything, slow_bf16_warning
from grpo_run.engine.launch import is_main_process
from grpo_run.envs.base import Environment
from grpo_run.envs.registry import build_environment, check_environment
from grpo_run.loop_state import LoopState
from grpo_run.models import dropout, lora
from grpo_run.models.forward import TrainingForward
from grpo_run.models.loading import load_model, load_tokenizer, resolve_model_path
from grpo_run.models.lora import LoraPolicy
from grpo_run.models.teacher import check_same_tokenizer, teacher_model_config, template_mismatch
from grpo_run.packing.settings import packing_line
from grpo_run.rollout.engines import GenerationEngine, LazyEngine
from grpo_run.rollout.groups import GroupSampler
from grpo_run.rollout.source import RolloutSource, SyncRollouts
from grpo_run.run_checks import fit_data
from grpo_run.safety.resume_policy import check_resume, check_steps_left
from grpo_run.safety.stop import stop_point
from grpo_run.scoring.levels import check_call_cost_levels
from grpo_run.scoring.pool import RewardPool
from grpo_run.scoring.run_scorer import RunScorer, check_columns, log_sandbox, reward_specs, run_scorer
from grpo_run.teacher import FrozenTeacher, SelfTeacher, Teacher
from grpo_run.tracking import ConsoleSink, JsonlSink, Sink, Tracker, console
from grpo_run.tracking.alarms import build_alarms
from grpo_run.tracking.wandb_run import WandbSink
from grpo_run.update import UpdateModels, UpdateSettings, loss_settings


@dataclass(frozen=True)
class RunContext:
    """The run's built parts: made once by `build_context`, then only read. What the loop changes as it
    runs is a `LoopState` (`start_state`)."""

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
    # The policy loss's fixed hyper-parameters (update.loss_settings), built once.
    loss: LossSettings
    # The checkpoint this run continues from (its loop state: `start_state`), None in a fresh run.
    resumed: checkpoint.TrainerState | None = None
    resumed_from: Path | None = None  # its folder (a state saved inside a step keeps the step's rest there)
    # eval.datasets: name -> held-out examples, each evaluated like eval_examples (eval/<name>/...).
    extra_eval_sets: dict[str, list[Example]] = field(default_factory=dict)
    # lora=default: the PEFT wrapper of `policy` (which is its base model with the adapters inside).
    lora: LoraPolicy | None = None
    # env != single_turn: the multi-turn environment each rollout's episodes talk to (None: single turn).
    environment: Environment | None = None
    # Where the step's scored groups come from (rollout=sync|async); built last, from the restored state.
    rollouts: RolloutSource | None = None
    # distill != none: the teacher that scores the student's sampled tokens (None: plain GRPO).
    teacher: Teacher | None = None
    _closers: list[Callable[[], None]] = field(default_factory=list)

    def reference_model(self) -> contextlib.AbstractContextManager[PreTrainedModel]:
        """π_ref for the block: the reference model, or with LoRA the policy with its adapter disabled."""
        if self.lora is not None:
            return self.lora.adapter_disabled()
        assert self.reference is not None  # loaded whenever beta > 0
        return contextlib.nullcontext(self.reference)

    def update_settings(self) -> UpdateSettings:
        """The update's hyper-parameters for the run (`update.UpdateSettings`)."""
        return UpdateSettings.of(self.cfg, self.loss)

    def update_models(self) -> UpdateModels:
        """The models a step's update reads, with the loop's stop point: the flag every rank agrees on
        (`safety.stop.stop_point`), before each micro-batch of every pass."""
        return UpdateModels(
            self.engine,
            self.forward,
            self.policy,
            reference=self.reference_model,
            teacher=self.teacher,
            stop=partial(stop_point, self.engine.broadcast_flag),
        )

    def close(self) -> None:
        if self.rollouts is not None:
            self.rollouts.close()
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


# The build steps training (`build_context`) and mode=eval (`build_eval_context`) share, in this order:
# the examples (bad data fails before any model loads), the tokenizer and the records it can take, the
# model (`load_model`), the generation engine (`backend.sampling_engine`).


def load_examples(cfg: Config) -> tuple[list[Example], list[Example], dict[str, list[Example]]]:
    """data's training and held-out splits, and every eval.datasets set by name."""
    train_examples, eval_examples = load_data(cfg.data, evaluate=evaluation_on(cfg))
    extra = {name: load_eval_split(d) for name, d in cfg.eval.datasets.items()}
    validate_group_by(cfg, eval_examples, extra)  # a held-out example without eval.group_by's column
    return train_examples, eval_examples, extra


def load_tokenizer_and_fit(
    cfg: Config,
    model_cfg: ModelConfig | None,
    train: list[Example] | None,
    held_out: list[Example],
    extra: dict[str, list[Example]],
):
    """(tokenizer, train, held_out, extra): prompts the model cannot take and too few records fail (or are
    skipped) here, before the model loads. train None: mode=eval, which has no training split;
    model_cfg None: cfg.model."""
    tokenizer = load_tokenizer(model_cfg or cfg.model)
    return (tokenizer, *fit_data(cfg, tokenizer, train, held_out, extra, model=model_cfg))


@dataclass(frozen=True)
class EvalContext:
    """mode=eval's built parts: the model to evaluate behind the generation engine a training run samples
    with, its held-out sets and the reward pool that scores them."""

    cfg: Config  # its model: the model evaluated (eval.checkpoint's settings, or a LoRA run's base)
    device: torch.device
    tokenizer: PreTrainedTokenizerBase
    generation: GenerationEngine
    eval_examples: list[Example]
    extra_eval_sets: dict[str, list[Example]]
    pool: RewardPool

    def close(self) -> None:
        self.pool.close()
        self.generation.close()


def checkpoint_model(cfg: Config) -> ModelConfig:
    """The model to evaluate: `eval.checkpoint` (a model folder, or a run dir holding final/), else cfg.model.

    A run's checkpoint loads with that run's own model settings unless the command line sets them."""
    if cfg.eval.checkpoint is None:
        return cfg.model
    folder = Path(cfg.eval.checkpoint).expanduser()
    if not (folder / "config.json").exists() and (folder / "final" / "config.json").exists():
        folder = folder / "final"
    model, settings = checkpoint_model_settings(folder, cfg.model, cfg.run_dir)
    console.print(settings, soft_wrap=True)
    return model


def build_eval_context(cfg: Config) -> EvalContext:
    """mode=eval: a model (or a run's checkpoint) and the engine that samples it, built with training's
    steps."""
    seed_everything(cfg.trainer.seed)
    device = resolve_device(cfg.trainer.device)
    _, examples, extra = load_examples(cfg)
    model_cfg = checkpoint_model(cfg)
    adapter = lora.adapter_folder(cfg.eval.checkpoint)  # a LoRA run: its base model plus final/'s adapter
    if adapter is not None:
        model_cfg = lora.base_model_config(model_cfg, adapter)  # the run's model settings, its base weights
    cfg = replace(cfg, model=model_cfg)  # the engine's autocast and bf16 copy follow the model evaluated
    tokenizer, _, examples, extra = load_tokenizer_and_fit(cfg, model_cfg, None, examples, extra)
    # Weights that require grad let autocast keep their bf16 copies for the whole decode loop instead of
    # casting every weight at every token (~1.5x faster generation); nothing here computes a gradient.
    model = load_model(model_cfg, device, trainable=True)
    if adapter is not None:
        model = lora.merged_with_adapter(model, adapter).requires_grad_(True)
    # The engine a training run samples and evaluates with (the same bf16 rounding of the weights).
    held_out = examples[: cfg.eval.num_prompts] + [x for s in extra.values() for x in s]
    role = backend.SamplingRole(owns_policy=True, model_cfg=model_cfg)
    generation = backend.sampling_engine(cfg, model, tokenizer, held_out, role)
    return EvalContext(
        cfg, device, tokenizer, generation, examples, extra, RewardPool(max_workers=cfg.reward.workers)
    )


def start_state(ctx: RunContext) -> LoopState:
    """The loop's state at its first step: fresh, or what the resumed checkpoint carried."""
    cfg = ctx.cfg
    alarms = build_alarms(
        cfg.alerts,
        cfg.generation,
        cfg.trainer,
        group_size=cfg.grpo.group_size,
        tracker=ctx.tracker if ctx.engine.is_main else None,
    )
    r = ctx.resumed
    if r is None:
        return LoopState(
            step=0,
            beta=cfg.grpo.beta,
            entropy_coef=cfg.grpo.entropy_coef,
            last_entropy=math.inf,
            nonfinite_streak=0,
            alarms=alarms,
        )
    alarms.load_state_dict(r.alarms)  # a resumed run continues its streaks
    return LoopState(
        step=r.step,
        beta=float(r.beta),
        entropy_coef=cfg.grpo.entropy_coef if r.entropy_coef is None else float(r.entropy_coef),
        last_entropy=math.inf if r.last_entropy is None else float(r.last_entropy),
        nonfinite_streak=r.nonfinite_streak,
        alarms=alarms,
        reward_failed_streak=r.reward_failed_streak,
    )


def precision_line(autocast_bf16: bool) -> str:
    """The run's precision and why, one line: the door's (it resolved model.autocast_bf16=auto against this
    machine), else the setting's own (a config built in code)."""
    own = resolve_autocast_bf16(autocast_bf16, "cpu", cpuinfo=None, cuda_bf16=False)[1]
    return precision_note(autocast_bf16) or own


def build_context(cfg: Config) -> RunContext:
    """The run's built parts, in the order that fails cheapest first: the config's and the data's checks,
    the ranks joined, the resume point, the tokenizer and the records it fits, the models, the engines,
    the main rank's run dir and sinks; then the checkpoint restored and the rollout source started."""
    train_examples, eval_examples, extra_eval_sets = checked_examples(cfg)
    # A built-in model's cached folder is made before the ranks join: once torch.distributed is
    # initialised, transformers' save_pretrained writes weights on rank 0 only.
    model_path = resolve_model_path(cfg.model)
    # lora.target_modules against the model's structure on the meta device, before any weights load.
    lora_targets = lora.check_targets(model_path, cfg.lora) if cfg.lora.enabled else None
    if is_main_process():  # a re-save of a step killed between its moves: its old copy goes back first
        checkpoint.restore_set_aside(Path(cfg.run_dir) / checkpoint.CHECKPOINTS)
    cfg, device = join_ranks(cfg, resolve_device(cfg.trainer.device))
    check_environment(cfg.env)  # so does an unknown env.name or an env._target_ that does not import
    resume_from, first_step = resume_point(cfg)
    tokenizer, train_examples, eval_examples, extra_eval_sets = load_tokenizer_and_fit(
        cfg, None, train_examples, eval_examples, extra_eval_sets
    )
    check_teacher_tokenizer(cfg, tokenizer)  # a teacher of another family fails before any weights load
    models = load_models(cfg, device, lora_targets)
    teacher = load_teacher(cfg, models.policy, tokenizer, device, train_examples)
    engine = build_engine(cfg, models.policy, device)
    t = cfg.trainer
    sampler = PromptSampler(train_examples, seed=cfg.data.seed + t.seed, batch_size=t.prompts_per_step)
    sinks = main_rank_start(cfg, models, device, resume_from, first_step) if engine.is_main else []
    # The held-out prompts a vLLM engine sizes its context for: the first eval.num_prompts of them.
    vllm_held_out = (eval_examples + [e for s in extra_eval_sets.values() for e in s])[: cfg.eval.num_prompts]

    def build_generation() -> GenerationEngine:
        examples = train_examples + vllm_held_out
        role = backend.SamplingRole(rank=engine.rank, lora=models.adapted)
        return backend.sampling_engine(cfg, models.policy, tokenizer, examples, role)

    # rollout=async: the worker samples the training groups; the trainer's engine only evaluates.
    generation = LazyEngine(build_generation) if cfg.rollout.mode == RolloutMode.ASYNC else build_generation()
    ctx = RunContext(
        cfg=cfg,
        device=device,
        tokenizer=tokenizer,
        policy=models.policy,
        reference=models.reference,
        engine=engine,
        generation=generation,
        forward=backend.training_forward(cfg, device),
        sampler=sampler,
        eval_examples=eval_examples,
        extra_eval_sets=extra_eval_sets,
        tracker=Tracker(sinks),
        rewards=run_scorer(cfg, len(train_examples), report_errors=engine.is_main),
        loss=loss_settings(cfg),
        lora=models.adapted,
        environment=build_environment(cfg.env),
        teacher=teacher,
    )
    return resumed_and_sourced(ctx, resume_from, first_step, train_examples)


def checked_examples(cfg: Config) -> tuple[list[Example], list[Example], dict[str, list[Example]]]:
    """The training, held-out and eval.datasets examples, with the checks that need only them and the
    config: nothing has been loaded or converted yet."""
    reward_specs(cfg.reward)  # a reward _target_ that does not import or cannot take TRL's call: before all
    check_call_cost_levels(cfg)  # env.call_cost against the levels reward.functions gives
    seed_everything(cfg.trainer.seed)
    # Bad data (or a dataset offline and not cached) fails first: before a built-in model is converted.
    train_examples, eval_examples, extra_eval_sets = load_examples(cfg)
    # A user reward's parameter that no column fills: named now, not as an error on every completion.
    check_columns(cfg.reward, {name for x in train_examples for name in x.columns})
    answered = any(x.answer for x in train_examples)
    validate_gold_answers(cfg, answered=answered)  # math_verifier needs gold
    check_teacher_context(cfg, answered=answered)  # so does distill=self's {answer}
    return train_examples, eval_examples, extra_eval_sets


def resume_point(cfg: Config) -> tuple[Path | None, int]:
    """(the checkpoint this run continues from, its step), or (None, 0): checked before anything loads."""
    checkpoint.refuse_symlinks(Path(cfg.run_dir))  # another run's checkpoint linked in: named, before loading
    resume_from = checkpoint.find_resume(cfg.resume, Path(cfg.run_dir))  # so does a bad resume path
    first_step = checkpoint.read_state(resume_from).step if resume_from else 0
    if resume_from is not None:
        check_steps_left(cfg.trainer.max_steps, resume_from, first_step)  # before anything loads
        applied = check_resume(cfg, resume_from)  # a changed key is applied or refused, never ignored
        if applied:
            console.print(f"resume: changed keys applied: {', '.join(applied)}", soft_wrap=True, markup=False)
    return resume_from, first_step


@dataclass(frozen=True)
class Models:
    """The trained models as loaded: the policy (with LoRA, the model inside `adapted`), the reference
    (None when β = 0 or with LoRA) and the modules whose dropout was zeroed."""

    policy: PreTrainedModel
    adapted: LoraPolicy | None
    reference: PreTrainedModel | None
    zeroed: list[str]


def load_models(cfg: Config, device: torch.device, lora_targets: list[str] | None) -> Models:
    """The policy (LoRA-wrapped when lora_targets is not None, its dropout zeroed when asked) and the
    reference model."""
    policy = load_model(cfg.model, device, trainable=True)
    adapted = (
        None if lora_targets is None else lora.wrap(policy, cfg.lora, lora_targets, seed=cfg.trainer.seed)
    )
    if adapted is not None:
        policy = adapted.model  # the same model object, its targeted projections now LoRA modules
    zeroed = dropout.disable_dropout(policy) if cfg.model.disable_dropout else []  # LoRA's too: after wrap
    # beta = 0: the KL term vanishes, so no reference model is loaded at all; with LoRA the reference
    # is the policy with its adapter disabled (`reference_model`), never a second copy.
    wants_reference = cfg.grpo.beta > 0 and adapted is None
    reference = load_model(cfg.model, device, trainable=False) if wants_reference else None
    return Models(policy, adapted, reference, zeroed)


def main_rank_start(
    cfg: Config, models: Models, device: torch.device, resume_from: Path | None, first_step: int
) -> list[Sink]:
    """The main rank only: what was built said on the console, the run dir made (and, on resume, trimmed
    to the checkpoint's step), and the sinks that log from `first_step` on."""
    if models.adapted is not None:
        console.print(lora.describe(models.adapted))
    said = dropout.describe(models.zeroed, disabled=cfg.model.disable_dropout, lora_dropout=cfg.lora.dropout)
    if said is not None:
        console.print(said, soft_wrap=True, markup=False, highlight=False)
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    if cfg.resume is not None:
        checkpoint.prepare_run_dir(run_dir, resume_from, first_step)
    sinks = build_sinks(cfg, first_step)
    log_sandbox(cfg.reward)
    console.print(precision_line(cfg.model.autocast_bf16), soft_wrap=True, markup=False, highlight=False)
    console.print(packing_line(cfg), soft_wrap=True, markup=False, highlight=False)
    slow = slow_bf16_warning(cfg.model.autocast_bf16, device)
    if slow is not None:
        console.print(slow, style="yellow", soft_wrap=True, markup=False, highlight=False)
    return sinks


def resumed_and_sourced(
    ctx: RunContext, resume_from: Path | None, first_step: int, train_examples: list[Example]
) -> RunContext:
    """`ctx` with the checkpoint restored (on resume) and its rollout source started from the restored
    state; closed when either fails."""
    try:
        if resume_from is not None:
            # Its RNG states replace those building drew from.
            state = checkpoint.restore(ctx.engine, ctx.cfg, resume_from)
            restore_sampler(ctx.sampler, state, resume_from)
            ctx.generation.policy_updated()
            ctx = replace(ctx, resumed=state, resumed_from=resume_from)
        # Last: a generation worker starts from the restored weights and sampler position. A checkpoint
        # saved inside step first_step + 1 holds that step's batch: the worker samples the steps after it.
        sampled_through = first_step + (1 if ctx.resumed and ctx.resumed.iterations_done else 0)
        rollouts = build_rollouts(ctx, train_examples, sampled_through)
    except BaseException:
        ctx.close()
        raise
    return replace(ctx, rollouts=rollouts)


def check_teacher_tokenizer(cfg: Config, tokenizer: PreTrainedTokenizerBase) -> None:
    """distill=teacher: the teacher's tokenizer, EOS id and chat template are the policy's, or a
    ConfigError naming both models (the last two: a warning line with allow_template_mismatch)."""
    if cfg.distill.kind == DistillKind.TEACHER:
        model_cfg = teacher_model_config(cfg.model, cfg.distill)
        theirs = load_tokenizer(model_cfg, key="distill.teacher.path")
        check_same_tokenizer(tokenizer, theirs, student_model=cfg.model, teacher_model=model_cfg)
        warning = template_mismatch(
            tokenizer,
            theirs,
            student_model=cfg.model,
            teacher_model=model_cfg,
            allow=cfg.distill.teacher.allow_template_mismatch,
        )
        if warning is not None:
            console.print(warning, style="yellow", soft_wrap=True, markup=False, highlight=False)


def load_teacher(
    cfg: Config,
    policy: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    device: torch.device,
    examples: list[Example],
) -> Teacher | None:
    """distill's teacher, None for distill=none. teacher: a frozen model loaded as the reference is, on
    every rank, on `distill.teacher.device` or the policy's (its tokenizer checked before:
    `check_teacher_tokenizer`); self: the policy itself (its adapter on, with LoRA), its prompt checked on the first example."""
    d, mbs = cfg.distill, cfg.trainer.micro_batch_size
    if d.kind == DistillKind.NONE:
        return None
    if d.kind == DistillKind.SELF:
        if examples:  # a placeholder no record can fill fails here, before the first step
            teacher_messages(cfg.data, examples[0], d.teacher_context)
        forward = backend.training_forward(cfg, device)
        return SelfTeacher(
            policy,
            forward,
            tokenizer,
            data=cfg.data,
            context=d.teacher_context,
            group_size=cfg.grpo.group_size,
            micro_batch_size=mbs,
        )
    model_cfg = teacher_model_config(cfg.model, d)
    where = device if d.teacher.device is None else torch.device(d.teacher.device)
    model = load_model(model_cfg, where, trainable=False, key="distill.teacher.path")
    return FrozenTeacher(model, backend.training_forward(cfg, where), where, mbs)


def build_rollouts(ctx: RunContext, examples: list[Example], start_step: int) -> RolloutSource:
    """The source `rollout.mode` names, over the run's sampling side (`GroupSampler`); rollout=async opens
    its box here and nowhere else."""
    engine = ctx.engine
    side = GroupSampler(
        ctx.cfg,
        sampler=ctx.sampler,
        generation=ctx.generation,
        tokenizer=ctx.tokenizer,
        rewards=ctx.rewards,
        device=ctx.device,
        environment=ctx.environment,
        rank=engine.rank,
        world_size=engine.world_size,
        ranks_max=engine.all_reduce_max,
    )
    if ctx.cfg.rollout.mode == RolloutMode.SYNC:
        return SyncRollouts(side)
    from grpo_run.asynchronous import build_async_rollouts

    lora = ctx.lora is not None
    return build_async_rollouts(
        side,
        policy=ctx.policy,
        lora=lora,
        examples=examples,
        start_step=start_step,
        scatter=engine.scatter_objects,
    )


def restore_sampler(sampler: PromptSampler, state: checkpoint.TrainerState, folder: Path) -> None:
    """The sampler continues where the checkpoint's run stood."""
    try:
        sampler.load_state_dict(state.sampler)
    except ValueError as err:
        raise checkpoint.CheckpointError(f"{folder}: {err}") from None
