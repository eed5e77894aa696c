"""One TRL GRPOTrainer run with the benchmark's settings; writes per-step timings as JSON.

Run by scripts/bench_vs_trl.py in its own process (never imported by grpo_run). It measures, it does
not change TRL's behaviour: a callback times each optimizer step; wrappers around GRPOTrainer's own
methods time its phases within the step (`_generate`: sampling; `_calculate_rewards`: the reward
functions; `_generate_and_score_completions`: the whole rollout; `compute_loss`: the training forward and
loss; `training_step`: a micro-batch's rollout share, forward, loss and backward) and count the completion
tokens and padded completion positions each micro-batch trains on; and the first micro-batch's loss is
recomputed with grpo-run's own functions on TRL's exact inputs.
"""

import argparse
import json
import time
from pathlib import Path

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from grpo_run.algo import LossInputs, LossSettings, policy_loss
from grpo_run.models.forward import completion_logprobs
from grpo_run.scoring.registry import get_reward_fn


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--prompts", required=True, help="JSONL with question/answer")
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--group-size", type=int, required=True)
    p.add_argument("--prompts-per-step", type=int, required=True)
    p.add_argument("--micro-batch-size", type=int, required=True)
    p.add_argument("--max-new-tokens", type=int, required=True)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--beta", type=float, default=0.0)
    p.add_argument("--epsilon", type=float, default=0.2)
    p.add_argument("--num-iterations", type=int, default=1)
    p.add_argument("--aggregation", choices=["per_response", "per_token"], default="per_response")
    p.add_argument("--bf16", action="store_true")
    p.add_argument(
        "--gradient-checkpointing",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="GRPOConfig.gradient_checkpointing (TRL's default: on)",
    )
    p.add_argument("--reward", default="math_verifier", help="a grpo-run reward function by name")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--threads", type=int, default=1, help="torch's intra-op threads")
    p.add_argument("--temperature", type=float, default=1.0)
    return p.parse_args()


def grpo_run_reward(name: str):
    """grpo-run's reward function `name` on TRL's conversational completions (same scores)."""
    fn = get_reward_fn(name)

    def reward(prompts, completions, answer, **_):
        texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
        return [0.0 if r is None else r for r in fn(prompts, texts, answer)]

    return reward


PHASES = ("generate", "reward", "rollout", "loss", "micro_batches", "tokens", "positions", "rows", "at_cap")


class StepTimer(TrainerCallback):
    """Each optimizer step's seconds, and per step the sums the method wrappers add to `current`."""

    def __init__(self) -> None:
        self.steps: list[float] = []
        self.phases: dict[str, list[float]] = {k: [] for k in PHASES}
        self.current = dict.fromkeys(PHASES, 0.0)
        self._t = 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        self._t = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.steps.append(time.perf_counter() - self._t)
        for k in PHASES:
            self.phases[k].append(self.current[k])
        self.current = dict.fromkeys(PHASES, 0.0)


def time_method(trainer, name: str, timer: StepTimer, phase: str) -> None:
    """Replace trainer.<name> by a wrapper adding its seconds to the step's `phase` (behaviour unchanged)."""
    original = getattr(trainer, name)

    def timed(*args, **kwargs):
        t = time.perf_counter()
        out = original(*args, **kwargs)
        timer.current[phase] += time.perf_counter() - t
        return out

    setattr(trainer, name, timed)


def main() -> None:
    a = parse()
    torch.set_num_threads(a.threads)
    rows = [json.loads(line) for line in Path(a.prompts).read_text().splitlines() if line.strip()]
    data = Dataset.from_list(
        [{"prompt": [{"role": "user", "content": r["question"]}], "answer": r["answer"]} for r in rows]
    )
    n = a.prompts_per_step * a.group_size
    cfg = GRPOConfig(
        output_dir=str(Path(a.out).with_suffix("")) + "_trl_out",
        per_device_train_batch_size=a.micro_batch_size,
        gradient_accumulation_steps=n // a.micro_batch_size,
        num_generations=a.group_size,
        max_completion_length=a.max_new_tokens,
        temperature=a.temperature,
        top_p=1.0,
        learning_rate=a.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        max_grad_norm=1.0,
        beta=a.beta,
        epsilon=a.epsilon,
        num_iterations=a.num_iterations,
        loss_type="grpo" if a.aggregation == "per_response" else "dapo",
        scale_rewards="group",
        max_steps=a.steps,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=a.device == "cpu",
        bf16=a.bf16,
        gradient_checkpointing=a.gradient_checkpointing,
        seed=a.seed,
        shuffle_dataset=False,
        disable_tqdm=True,
    )
    tokenizer = AutoTokenizer.from_pretrained(a.model)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    timer = StepTimer()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=grpo_run_reward(a.reward),
        args=cfg,
        train_dataset=data,
        processing_class=tokenizer,
        callbacks=[timer],
    )

    for name, phase in (
        ("_generate", "generate"),
        ("_calculate_rewards", "reward"),
        ("_generate_and_score_completions", "rollout"),
        ("compute_loss", "loss"),
        ("training_step", "micro_batches"),
    ):
        time_method(trainer, name, timer, phase)

    check: dict = {}
    seen_logps: list[torch.Tensor] = []
    original_logps = trainer._get_per_token_logps_and_entropies

    def recorded_logps(*args, **kwargs):
        out = original_logps(*args, **kwargs)
        if not seen_logps and torch.is_grad_enabled():  # the first training forward, not a no-grad pass
            seen_logps.append(out[0].detach())
        return out

    trainer._get_per_token_logps_and_entropies = recorded_logps
    original_loss = trainer._compute_loss

    def checked_loss(model, inputs):
        # TRL pads every row of a generation batch to its longest completion: count what that costs.
        timer.current["tokens"] += float(inputs["completion_mask"].sum())
        timer.current["positions"] += float(inputs["completion_mask"].numel())
        lengths = inputs["completion_mask"].sum(1)
        timer.current["rows"] += float(lengths.numel())
        timer.current["at_cap"] += float((lengths >= a.max_new_tokens).sum())
        loss = original_loss(model, inputs)
        if not check:
            check.update(loss_check(trainer, model, inputs, loss, a, seen_logps[0]))
        return loss

    trainer._compute_loss = checked_loss
    trainer.train()
    peak_gpu = torch.cuda.max_memory_allocated() / 2**30 if a.device == "cuda" else None
    result = {
        "step_s": timer.steps,
        "generate_s": timer.phases["generate"],
        "phases": timer.phases,
        "loss_check": check,
        "peak_gpu_gb": peak_gpu,
    }
    Path(a.out).write_text(json.dumps(result))


@torch.no_grad()
def loss_check(trainer, model, inputs, trl_loss, a, trl_logps) -> dict:
    """grpo-run's log-probs and policy loss on TRL's first micro-batch, scaled to one step."""
    n_step = a.prompts_per_step * a.group_size
    with torch.autocast(a.device, dtype=torch.bfloat16, enabled=a.bf16):
        logprobs, _ = completion_logprobs(
            model,
            inputs["prompt_ids"],
            inputs["prompt_mask"],
            inputs["completion_ids"],
            temperature=a.temperature,
            chunk_size=1024,
        )
    mask = inputs["completion_mask"].float()
    normalizer = float(n_step) if a.aggregation == "per_response" else inputs["num_items_in_batch"].float()
    old = logprobs if inputs.get("old_per_token_logps") is None else inputs["old_per_token_logps"]
    ours = policy_loss(
        LossInputs(logprobs, old, inputs["advantages"], mask),
        LossSettings(epsilon=a.epsilon, epsilon_high=a.epsilon, aggregation=a.aggregation),
        beta=0.0,
        normalizer=normalizer,
    )
    gap = (logprobs - trl_logps).abs() * mask  # [n, T]
    return {
        "trl_loss": float(trl_loss.detach()),
        "grpo_run_loss": float(ours.loss),
        "max_logprob_gap": float(gap.max()),
        "mean_logprob_gap": float(gap.sum() / mask.sum()),
    }


if __name__ == "__main__":
    main()
