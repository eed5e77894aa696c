"""TRL's GRPOConfig field names, and the key each one is here (or why grpo-run has none).

A user coming from TRL types `learning_rate=1e-5` or `grpo.num_generations=8`. Hydra (and the door, for
a key added with `+`) refuses the unknown key, and `trl_hint` turns the refusal into "did you mean
trainer.lr?": the leaf of the refused key is looked up here whatever section it was put under. This table
is also the one in docs/configuration.md ("Coming from TRL's GRPOConfig"): tests/config/test_trl_names.py
checks that every key it names exists in the composed config and that the docs list every entry.
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class Ours:
    """The TRL field is this key here (`[i]`: each entry of the list)."""

    key: str
    note: str = ""  # what differs: the unit, the default, the values, a group that sets it


@dataclass(frozen=True)
class NotOffered:
    """grpo-run has no such setting, for this reason."""

    reason: str


_REFERENCE_SYNC = "belongs to sync_ref_model, which grpo-run does not offer"

# Grouped as the docs table is: model and precision, batch, algorithm, sampling and vLLM, the loop, logging.
TRL_NAMES: dict[str, Ours | NotOffered] = {
    # The model and its precision.
    "model_init_kwargs": Ours(
        "model.dtype",
        "TRL's dict of from_pretrained arguments; grpo-run's typed keys for them: model.dtype, "
        "model.attn_implementation, model.trust_remote_code",
    ),
    "trust_remote_code": Ours("model.trust_remote_code"),
    "gradient_checkpointing": Ours("model.gradient_checkpointing", "TRL's default true, ours false"),
    "bf16": Ours(
        "model.autocast_bf16",
        "TRL's default true (when fp16 is off); ours auto: bf16 autocast where the hardware computes bf16, "
        "float32 elsewhere; DeepSpeed's own switch is distributed.bf16",
    ),
    "fp16": NotOffered(
        "float16 mixed precision needs loss scaling, which grpo-run does not implement; bf16 autocast "
        "(model.autocast_bf16) is the mixed precision it offers"
    ),
    "disable_dropout": Ours("model.disable_dropout", "the same default, true; LoRA's dropout included"),
    # The batch.
    "num_generations": Ours("grpo.group_size"),
    "per_device_train_batch_size": Ours(
        "trainer.micro_batch_size",
        "completions per forward/backward on one rank, as TRL's; TRL's default 8, ours 16; the step's size "
        "is trainer.prompts_per_step",
    ),
    "gradient_accumulation_steps": Ours(
        "trainer.prompts_per_step",
        "derived, not set: a step of B prompts accumulates B x grpo.group_size / (ranks x "
        "trainer.micro_batch_size) micro-batches",
    ),
    "generation_batch_size": Ours(
        "trainer.prompts_per_step",
        "counted in prompts: one generation is trainer.prompts_per_step x grpo.group_size completions",
    ),
    "steps_per_generation": NotOffered(
        "one generation's completions make exactly one optimizer step per grpo.num_iterations pass; TRL's "
        "steps_per_generation above gradient_accumulation_steps splits a generation over several steps"
    ),
    "num_iterations": Ours(
        "grpo.num_iterations",
        "each pass over the step's completions is one optimizer step, as in TRL with "
        "steps_per_generation = gradient_accumulation_steps",
    ),
    "max_prompt_length": Ours(
        "data.max_prompt_tokens",
        "a longer prompt is skipped and counted, never cut; TRL 1.16's GRPOConfig has no such field "
        "(older TRL cut prompts from the left)",
    ),
    "max_completion_length": Ours("generation.max_new_tokens", "TRL's default 512, ours 32"),
    # The algorithm.
    "beta": Ours("grpo.beta", "0.0 in both (no reference model is loaded); experiment=grpo sets 0.04"),
    "epsilon": Ours("grpo.epsilon"),
    "epsilon_high": Ours(
        "grpo.epsilon_high",
        "null means epsilon in both; under TRL's loss_type=cispo it is the cap, here grpo.cispo_cap",
    ),
    "delta": Ours("grpo.delta"),
    "loss_type": Ours(
        "grpo.aggregation",
        "set by the aggregation= group: TRL's default dapo is aggregation=per_token; grpo is per_response, "
        "our default; bnpo is per_token, though TRL counts one micro-batch's tokens and grpo-run the "
        "step's; dr_grpo is constant_length; cispo and sapo are experiment=cispo and experiment=sapo; "
        "luspo and vespo are not offered",
    ),
    "scale_rewards": Ours(
        "grpo.advantage_mode",
        "set by the advantage_mode= group: TRL's default group is normalized (TRL divides by the sample "
        "std + 1e-4: std_correction=sample grpo.advantage_eps=1e-4); batch is normalized_batch; none is "
        "centered",
    ),
    "multi_objective_aggregation": Ours("reward.aggregation"),
    "reward_weights": Ours("reward.functions[i].weight", "one weight per reward entry, 1.0 by default"),
    "mask_truncated_completions": Ours("grpo.mask_truncated"),
    "importance_sampling_level": Ours("grpo.importance_level"),
    "top_entropy_quantile": Ours("grpo.top_entropy_quantile"),
    "entropy_coef": Ours("grpo.entropy_coef"),
    "use_adaptive_entropy": Ours("grpo.entropy_control", "true is grpo.entropy_control=adaptive"),
    "entropy_target": Ours("grpo.entropy_target"),
    "entropy_coef_delta": Ours("grpo.entropy_coef_delta"),
    "entropy_coef_min": Ours("grpo.entropy_coef_min"),
    "entropy_coef_max": Ours("grpo.entropy_coef_max"),
    "sapo_temperature_pos": Ours("grpo.sapo_tau_pos"),
    "sapo_temperature_neg": Ours("grpo.sapo_tau_neg"),
    "off_policy_mask_threshold": Ours("grpo.off_policy_mask_threshold"),
    "use_bias_correction_kl": Ours(
        "grpo.kl_bias_correction", "TRL's default true, ours false; it acts only when grpo.beta > 0"
    ),
    "sync_ref_model": NotOffered(
        "the reference model stays the initial policy for the whole run: TR-DPO's syncing is not implemented"
    ),
    "ref_model_mixup_alpha": NotOffered(_REFERENCE_SYNC),
    "ref_model_sync_steps": NotOffered(_REFERENCE_SYNC),
    # Sampling and vLLM.
    "temperature": Ours("generation.temperature", "TRL's default 1.0, ours 0.7"),
    "top_p": Ours("generation.top_p"),
    "top_k": Ours("generation.top_k", "0 turns it off in both"),
    "min_p": Ours("generation.min_p", "TRL's null and our 0.0 both turn it off"),
    "repetition_penalty": NotOffered(
        "the samplers apply temperature, top-k, top-p and min-p only; a penalty on the text so far is not "
        "implemented"
    ),
    "generation_kwargs": NotOffered(
        "the sampler's settings are typed keys under generation.*; no free-form dict is passed through"
    ),
    "use_vllm": Ours(
        "generation.engine", "true is generation=vllm; false (both defaults) is generation=local"
    ),
    "vllm_mode": Ours(
        "generation.engine",
        "grpo-run's vLLM engine is always colocated (TRL's default colocate); server mode is not offered",
    ),
    "vllm_gpu_memory_utilization": Ours("generation.vllm.gpu_memory_utilization"),
    "vllm_max_model_length": Ours(
        "generation.vllm.max_model_len",
        "null: TRL takes the model's context, grpo-run the longest prompt + generation.max_new_tokens",
    ),
    "vllm_enable_sleep_mode": Ours("generation.vllm.sleep_mode"),
    "vllm_tensor_parallel_size": NotOffered(
        "one colocated engine per training process runs on that process's GPU; no tensor parallelism"
    ),
    "vllm_importance_sampling_correction": Ours(
        "grpo.rollout_correction", "false is grpo.rollout_correction=none; true (both defaults) is a mode"
    ),
    "vllm_importance_sampling_mode": Ours(
        "grpo.rollout_correction",
        "token_truncate is token_tis, sequence_truncate is sequence_tis; token_mask and sequence_mask "
        "(both defaults) keep their names",
    ),
    "vllm_importance_sampling_clip_max": Ours("grpo.rollout_correction_cap"),
    "vllm_importance_sampling_cap": Ours("grpo.rollout_correction_cap", "TRL's older name of clip_max"),
    "vllm_importance_sampling_clip_min": Ours("grpo.rollout_correction_min"),
    # The loop and the optimizer.
    "learning_rate": Ours("trainer.lr", "TRL's default 1e-6, ours 3e-5"),
    "num_train_epochs": Ours(
        "trainer.max_steps",
        "a run is counted in steps; one epoch is (training records / trainer.prompts_per_step) steps, "
        "rounded down",
    ),
    "max_steps": Ours(
        "trainer.max_steps",
        "TRL counts optimizer steps (default -1: num_train_epochs decides), grpo-run counts generations, "
        "each grpo.num_iterations optimizer steps; ours defaults to 32",
    ),
    "warmup_steps": Ours("trainer.warmup_steps", "a whole number of steps (TRL also takes a ratio below 1)"),
    "warmup_ratio": Ours("trainer.warmup_steps", "a number of steps: the ratio times trainer.max_steps"),
    "lr_scheduler_type": Ours(
        "trainer.lr_scheduler", "constant, linear (both defaults) or cosine, each after the warmup"
    ),
    "weight_decay": Ours("trainer.weight_decay"),
    "max_grad_norm": Ours("trainer.max_grad_norm"),
    "adam_beta1": Ours("trainer.adam_beta1"),
    "adam_beta2": Ours("trainer.adam_beta2", "TRL's default 0.999, ours 0.99"),
    "adam_epsilon": NotOffered("AdamW's epsilon stays torch's 1e-8, which is TRL's default too"),
    "optim": Ours(
        "trainer.fused_adamw", "AdamW only: fused (true, as TRL's default adamw_torch_fused) or not"
    ),
    "seed": Ours("trainer.seed", "TRL's default 42, ours 0"),
    "use_cpu": Ours("trainer.device", "true is trainer.device=cpu"),
    "deepspeed": Ours(
        "distributed.kind",
        "distributed=zero2 (or zero2_offload) builds the DeepSpeed JSON from trainer.*; ZeRO-3 and a JSON "
        "file of your own are not offered",
    ),
    "ddp_timeout": Ours("distributed.timeout_s", "TRL's default 1800 s, ours 600 s"),
    "resume_from_checkpoint": Ours("resume", "auto: the run dir's newest complete checkpoint; or its path"),
    "max_tool_calling_iterations": Ours(
        "env.max_turns",
        "model turns per episode of a multi-turn env= (calculator, python_tool); TRL's null is no limit, "
        "ours 4",
    ),
    # Logging, evaluation and saving.
    "output_dir": Ours("hydra.run.dir", "default: a fresh timestamped folder under outputs/runs/"),
    "report_to": Ours(
        "logger.wandb",
        "logger=wandb (the default; offline without an API key) or logger=console; TRL's default none",
    ),
    "run_name": Ours("logger.name"),
    "logging_steps": Ours(
        "logger.print_every",
        "metrics.jsonl and W&B get every step, this thins the console line only; TRL's default 10, ours 1",
    ),
    "log_completions": Ours(
        "logger.log_completions_every",
        "a completions table every N steps (0: never; logger=wandb sets 10); TRL's default false",
    ),
    "eval_strategy": Ours("eval.every_steps", "0 is off; TRL's default no, ours step 0 and every 32 steps"),
    "eval_steps": Ours("eval.every_steps"),
    "num_generations_eval": Ours(
        "eval.samples_per_prompt", "k of mean@k (pass@1 is greedy); TRL's null is num_generations, ours 4"
    ),
    "save_steps": Ours(
        "checkpoint.every_steps", "TRL's default 500; ours 0: at the end and on preemption only"
    ),
    "save_total_limit": Ours("checkpoint.keep_last", "TRL's default null keeps all, ours keeps 2"),
}


def trl_hint(full_key: str) -> str:
    """'trainer.learning_rate is TRL's GRPOConfig name; did you mean trainer.lr?' for a refused key whose
    last part is a TRL GRPOConfig field (`[i]` indices dropped), or ''."""
    leaf = full_key.rpartition(".")[2].partition("[")[0]
    entry = TRL_NAMES.get(leaf)
    if entry is None:
        return ""
    said = f"{full_key} is TRL's GRPOConfig name"
    if isinstance(entry, NotOffered):
        return f"{said}; grpo-run does not offer it: {entry.reason}"
    note = f" ({entry.note})" if entry.note else ""
    return f"{said}; did you mean {entry.key}?{note}"
