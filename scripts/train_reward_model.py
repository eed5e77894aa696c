"""Fit a sequence-classification reward model on the base model's own right and wrong answers.

    python scripts/train_reward_model.py --out outputs/rm-smollm2 model=smollm2-135m data=arithmetic
    grpo-run reward=reward_model reward.functions.0.model.path=outputs/rm-smollm2

1. The base model (`model=`, any grpo-run model option or `model.path`) samples `--samples` completions for
   each of `--prompts` training problems of `data=` (arithmetic by default), as a run's first step would
   (its chat prompts, `generation.temperature`, `generation.max_new_tokens`).
2. math_verifier labels each completion right (1) or wrong (0).
3. The base model with a one-logit classification head reads each (question, completion) exactly as the
   reward entry will (grpo_run/scoring/model_reward.py: `classifier_texts`, the head on the last token);
   the body stays frozen, so its pooled features are computed once, and only the head is fitted, by
   logistic loss (the logit is then log-odds of "right"), with AdamW for `--steps` full-batch steps.
4. The classifier and its tokenizer are saved to `--out`, loaded back the way `reward=` loads them, and
   scored on the held-out problems' completions (`--held-out` of the prompts): the accuracy of
   "logit > 0" beside that of always giving the majority label, the ranking AUC (the chance a right
   answer outscores a wrong one) and the mean logit of right and of wrong answers are printed and
   written to `--out/rm_report.json`.

KEY=VALUE arguments are grpo-run overrides (model=tiny for a smoke test, trainer.device=cuda, ...).
Sampling takes most of the time: SmolLM2-135M on a 2-core CPU, the defaults (256 prompts x 4 samples of
32 tokens) take minutes.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

from grpo_run.cli import CONF_DIR
from grpo_run.config import Config, to_config
from grpo_run.data.prompts import chat_prompts
from grpo_run.data.splits import load_data
from grpo_run.engine.device import resolve_device, seed_everything
from grpo_run.models.frozen import HEAD_CLASSES, FrozenSpec, Head, classifier_scores, load_frozen
from grpo_run.models.loading import load_model, load_tokenizer, pretrained, resolve_model_path
from grpo_run.rewards.functions import math_verifier
from grpo_run.scoring.model_reward import classifier_texts


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="the reward model's folder")
    parser.add_argument("--prompts", type=int, default=256, help="training problems sampled")
    parser.add_argument("--samples", type=int, default=4, help="completions per problem")
    parser.add_argument("--held-out", type=float, default=0.2, help="share of the problems kept for scoring")
    parser.add_argument("--steps", type=int, default=300, help="full-batch optimizer steps on the head")
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--batch", type=int, default=16, help="problems per generation / feature batch")
    args, overrides = parser.parse_known_args(argv)
    unknown = [o for o in overrides if "=" not in o or o.startswith("-")]
    if unknown:
        parser.error(f"unrecognised arguments: {unknown} (overrides are KEY=VALUE)")
    return args, overrides


def compose_config(overrides: list[str]) -> Config:
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return to_config(compose(config_name="config", overrides=["model=smollm2-135m", *overrides]))


@torch.inference_mode()
def sample(cfg: Config, model, tokenizer, problems, samples: int, batch: int, device) -> list[dict]:
    """Each problem's `samples` completions, labelled right (1.0) or wrong (0.0) by math_verifier."""
    rows = []
    g = cfg.generation
    for start in range(0, len(problems), batch):
        chunk = problems[start : start + batch]
        enc = tokenizer(
            chat_prompts(tokenizer, cfg.data, chunk),
            return_tensors="pt",
            padding=True,
            add_special_tokens=False,
        ).to(device)
        out = model.generate(
            **enc,
            do_sample=True,
            temperature=g.temperature,
            top_p=g.top_p,
            max_new_tokens=g.max_new_tokens,
            num_return_sequences=samples,
            pad_token_id=tokenizer.pad_token_id,
        )  # [len(chunk) * samples, P + T]
        completions = tokenizer.batch_decode(out[:, enc["input_ids"].size(1) :], skip_special_tokens=True)
        questions = [e.question for e in chunk for _ in range(samples)]
        answers = [e.answer for e in chunk for _ in range(samples)]
        labels = math_verifier(
            questions, completions, answers, fallback_last_number=cfg.data.fallback_last_number
        )
        for i, (q, c, label) in enumerate(zip(questions, completions, labels, strict=True)):
            if label is not None:  # an unparseable gold teaches nothing
                rows.append({"problem": start + i // samples, "question": q, "completion": c, "label": label})
        print(f"sampled {min(start + batch, len(problems))}/{len(problems)} problems", flush=True)
    return rows


@torch.no_grad()  # not inference mode: the head's fit takes these features into autograd
def pooled_features(classifier, tokenizer, rows: list[dict], batch: int, device) -> torch.Tensor:
    """The body's last hidden state at each text's last token: what the head reads (right padding)."""
    features = []
    for start in range(0, len(rows), batch):
        chunk = rows[start : start + batch]
        texts, templated = classifier_texts(
            tokenizer, [r["question"] for r in chunk], [r["completion"] for r in chunk]
        )
        enc = tokenizer(
            texts, padding=True, padding_side="right", add_special_tokens=not templated, return_tensors="pt"
        ).to(device)
        hidden = classifier.base_model(**enc).last_hidden_state  # [n, L, H]
        last = enc["attention_mask"].sum(dim=1) - 1  # [n]
        features.append(hidden[torch.arange(hidden.size(0), device=device), last].float())
    return torch.cat(features)  # [N, H]


def fit_head(head: torch.nn.Linear, features: torch.Tensor, labels: torch.Tensor, args) -> None:
    """Logistic regression of the labels on the features through the head's weights (in place)."""
    params = list(head.parameters())
    for p in params:
        p.requires_grad_(True)
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay)
    weight = head.weight
    for step in range(1, args.steps + 1):
        logits = torch.nn.functional.linear(
            features, weight.float(), None if head.bias is None else head.bias.float()
        )
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits[:, 0], labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step == 1 or step % max(args.steps // 10, 1) == 0 or step == args.steps:
            accuracy = ((logits[:, 0] > 0).float() == labels).float().mean()
            print(
                f"step {step}/{args.steps}  loss {loss.item():.4f}  train accuracy {accuracy.item():.3f}",
                flush=True,
            )
    for p in params:
        p.requires_grad_(False)


def ranking_auc(right: list[float], wrong: list[float]) -> float | None:
    """The chance that a right completion outscores a wrong one, ties counting half (ROC AUC). Unlike the
    accuracy of "logit > 0", it cannot be earned by always giving the majority label: when most sampled
    answers are wrong, that alone scores the share of wrong ones."""
    if not right or not wrong:
        return None
    wins = sum((r > w) + 0.5 * (r == w) for r in right for w in wrong)
    return wins / (len(right) * len(wrong))


def report(out: Path, rows: list[dict], cfg: Config) -> dict:
    """The saved folder loaded as `reward=` loads it, scoring the held-out completions."""
    frozen = load_frozen(FrozenSpec(str(out), cfg.model.dtype, "cpu"), Head.SEQUENCE_CLASSIFIER)
    texts, templated = classifier_texts(
        frozen.tokenizer, [r["question"] for r in rows], [r["completion"] for r in rows]
    )
    scores = []
    for start in range(0, len(texts), 16):
        scores += classifier_scores(frozen, texts[start : start + 16], add_special_tokens=not templated)
    right = [s for s, r in zip(scores, rows, strict=True) if r["label"] == 1.0]
    wrong = [s for s, r in zip(scores, rows, strict=True) if r["label"] == 0.0]
    correct = sum((s > 0) == (r["label"] == 1.0) for s, r in zip(scores, rows, strict=True))
    return {
        "held_out_completions": len(rows),
        "held_out_right": len(right),
        "accuracy": correct / len(rows) if rows else None,
        "majority_accuracy": max(len(right), len(wrong)) / len(rows) if rows else None,
        "auc": ranking_auc(right, wrong),
        "mean_logit_right": sum(right) / len(right) if right else None,
        "mean_logit_wrong": sum(wrong) / len(wrong) if wrong else None,
    }


def main(argv: list[str]) -> dict:
    args, overrides = parse_args(argv)
    cfg = compose_config(overrides)
    seed_everything(cfg.trainer.seed)
    device = resolve_device(cfg.trainer.device)
    started = time.perf_counter()
    train, _ = load_data(cfg.data)
    problems = train[: args.prompts]
    tokenizer = load_tokenizer(cfg.model)
    policy = load_model(cfg.model, device, trainable=False)
    rows = sample(cfg, policy, tokenizer, problems, args.samples, args.batch, device)
    del policy
    held = set(
        random.Random(cfg.trainer.seed).sample(range(len(problems)), int(len(problems) * args.held_out))
    )
    fit_rows = [r for r in rows if r["problem"] not in held]
    held_rows = [r for r in rows if r["problem"] in held]
    right = sum(r["label"] for r in fit_rows)
    print(f"{len(fit_rows)} completions to fit ({right:.0f} right), {len(held_rows)} held out", flush=True)

    classifier = pretrained(
        HEAD_CLASSES[Head.SEQUENCE_CLASSIFIER],
        resolve_model_path(cfg.model),
        dtype=cfg.model.dtype,
        trust_remote_code=cfg.model.trust_remote_code,
        num_labels=1,
    )
    classifier.config.pad_token_id = tokenizer.pad_token_id
    classifier.to(device).eval().requires_grad_(False)
    torch.nn.init.zeros_(classifier.score.weight)  # start at logit 0 (P = 1/2), not at a random head
    features = pooled_features(classifier, tokenizer, fit_rows, args.batch, device)
    labels = torch.tensor([r["label"] for r in fit_rows], device=device)
    fit_head(classifier.score, features, labels, args)

    args.out.mkdir(parents=True, exist_ok=True)
    classifier.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    result = {**report(args.out, held_rows, cfg), "fit_completions": len(fit_rows), "fit_right": right}
    result["seconds"] = round(time.perf_counter() - started, 1)
    (args.out / "rm_report.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    print(f"reward model saved: grpo-run reward=reward_model reward.functions.0.model.path={args.out}")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
