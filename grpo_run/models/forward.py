"""Per-token log-probs (and entropy) of completions under a model, from one forward pass."""

import torch

from grpo_run.algo import head_token_logprobs, token_entropy, token_logprobs, token_logprobs_and_entropy
from grpo_run.models.native import LlamaLayers, native_hidden, resolve_backend
from grpo_run.models.shared_prompt import shared_prompt_hidden
from grpo_run.models.weight_casts import WeightCasts


def trim_columns(
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Drop prompt columns that are padding in every row and completion columns past the last token.

    Left padding and finished sequences leave columns no row needs; attention never lets a later
    column change an earlier one, so the log-probs of the kept tokens are unchanged.
    """
    keep_from = int(prompt_mask.any(dim=0).int().argmax())  # first column with a real token
    keep_to = max(int(completion_mask.sum(dim=1).max()), 1)
    return (
        prompt_ids[:, keep_from:],
        prompt_mask[:, keep_from:],
        completion_ids[:, :keep_to],
        completion_mask[:, :keep_to],
    )


def concatenated(
    prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's prompt [n, P] and completion [n, T] as one sequence: (ids, mask, positions [n, P+T],
    the T columns [T] that predict the completion tokens)."""
    t = completion_ids.size(1)
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)  # [n, P+T]
    attention = torch.cat([prompt_mask, torch.ones_like(completion_ids)], dim=1)  # [n, P+T]
    positions = (attention.cumsum(dim=1) - 1).clamp(min=0)  # [n, P+T]
    # Column P-1+j predicts completion token j: only those T columns go through the LM head, so the
    # logits come out contiguous (no [n, T+1, V] tensor sliced and copied, no unused last column).
    cols = torch.arange(input_ids.size(1) - t - 1, input_ids.size(1) - 1, device=input_ids.device)  # [T]
    return input_ids, attention, positions, cols


def head_input(
    net: LlamaLayers,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    *,
    share_prompts: bool,
) -> torch.Tensor:
    """Native backend: prompt [n, P] + completion [n, T] -> the LM head's input [n, T, hidden] at the
    columns that predict the completion (rows sharing a prompt share its forward with `share_prompts`)."""
    hidden = shared_prompt_hidden(net, prompt_ids, prompt_mask, completion_ids) if share_prompts else None
    if hidden is None:  # not asked for, or nothing to share
        ids, attention, positions, cols = concatenated(prompt_ids, prompt_mask, completion_ids)
        hidden = native_hidden(net, ids, attention, positions)[:, cols]
    return net.final_norm(hidden)


def completion_logprobs(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    *,
    temperature: float,
    chunk_size: int,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    backend: str = "auto",
    share_prompts: bool = False,
    weight_casts: WeightCasts | None = None,
    fused_head: bool = False,
    trim_every_layers: int = 0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """prompt [n, P] + completion [n, T] → (log-probs [n, T], entropy [n, T] or None).

    Log-probs come from the temperature-scaled logits, the distribution the tokens were sampled
    from. Only the T positions that predict a completion token go through the LM head. The entropy
    carries gradient only with `entropy_grad` (an entropy bonus in the loss); as a metric it is
    computed without autograd.
    backend (`trainer.forward_backend`): 'native' (`models/native.py`, Llama family), 'hf'
    (transformers' forward) or 'auto' (native where it can run); the same logits either way.
    share_prompts (`trainer.shared_prompt_forward`, native backend): rows with the same prompt share
    its forward (`models/shared_prompt.py`).
    weight_casts (`trainer.cast_weights_once`, native backend, bf16 autocast): the projections' weights
    cast once per optimizer step instead of at every use (`models/weight_casts.py`).
    fused_head (`trainer.fused_lm_head`, native backend, no entropy gradient): the LM head and the
    log-softmax run chunk by chunk of rows (`algo.head_token_logprobs`), so no [n, T, V] logits exist.
    trim_every_layers (`trainer.release_free_memory_layers`, native backend, training): the C heap's free
    pages go back to the OS every this many layers (`native.run_layers`).
    """
    if resolve_backend(model, backend, "trainer.forward_backend") == "native":
        net = LlamaLayers(model, weight_casts, trim_every_layers, head_follows=True)
        hidden = head_input(net, prompt_ids, prompt_mask, completion_ids, share_prompts=share_prompts)
        if fused_head and not entropy_grad and model.get_output_embeddings().bias is None:
            weight, grad_blocks = net.head_weight()  # [V, hidden]
            device = weight.device.type
            dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype
            return head_token_logprobs(
                hidden,
                weight,
                completion_ids,
                temperature,
                chunk_size,
                with_entropy=with_entropy,
                dtype=dtype,
                weight_grad_blocks=grad_blocks,
            )
        logits = net.linear(model.get_output_embeddings(), hidden)  # [n, T, V]
    else:
        ids, attention, positions, cols = concatenated(prompt_ids, prompt_mask, completion_ids)
        logits = model(
            input_ids=ids, attention_mask=attention, position_ids=positions, logits_to_keep=cols
        ).logits
    if with_entropy and not entropy_grad:  # the metric: one log-softmax pass gives both
        return token_logprobs_and_entropy(logits, completion_ids, temperature, chunk_size)
    logprobs = token_logprobs(logits, completion_ids, temperature=temperature, chunk_size=chunk_size)
    entropy = None
    if with_entropy:
        entropy = token_entropy(logits, temperature=temperature, chunk_size=chunk_size)  # [n, T]
    return logprobs, entropy
