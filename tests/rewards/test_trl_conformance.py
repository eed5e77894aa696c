"""grpo-run's reward call against TRL 1.16's own GRPOTrainer, on the same records and completions.

TRL's trainer runs for real (a tiny model built in code, 2 steps); its `rollout_func` (TRL's hook for a
custom generator) hands it fixed completions, so both sides score the same text. Recorded from TRL's own
code: each function's values (`_calculate_rewards`), the group advantages (`_generate_and_score_completions`)
and the `trainer_state` a reward received. grpo-run's `RunScorer` then scores what TRL's functions were
given, the functions named by `_target_` exactly as written for TRL, and `compute_advantages` with TRL's
settings (scale_rewards="group": σ with G - 1, eps 1e-4) turns the totals into advantages.

Where the two differ on purpose the test says so: a completion every function says None for is unscorable
(no total, advantage 0) on both sides, as TRL 1.16 does; grpo-run also counts it (train/reward_unscorable).
"""

import math

import pytest
import torch

trl = pytest.importorskip("trl")  # a test-only extra (pyproject's `test`), installed by `make test`

from datasets import Dataset  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from grpo_run.algo import compute_advantages  # noqa: E402
from grpo_run.config.schema import RewardConfig, RewardFunctionConfig  # noqa: E402
from grpo_run.models.tiny import build_model, build_tokenizer  # noqa: E402
from grpo_run.scoring import RewardPool, UserInputs  # noqa: E402
from grpo_run.scoring.run_scorer import RunScorer  # noqa: E402
from tests.rewards import trl_rewards as R  # noqa: E402

G = 4
STEPS = 2
MODULE = "tests.rewards.trl_rewards"
# One multi-task dataset: math rows, code rows, and a "chat" row neither task's reward applies to.
RECORDS = [
    ("What is 2 + 3?", "math", "5", ["5", "it is 5!", "6", "no idea"]),
    ("Write add.", "code", "", ["def add(): pass", "def a(): def b()", "nothing!", "x = 1"]),
    ("What is 7 - 4?", "math", "3", ["3!", "4", "3 or 4", "thirty"]),
    ("Say hi.", "chat", "", ["hi", "hello!", "hey 1", "yo"]),
]
# TRL's shipped rewards read conversational completions; their rows carry a `solution` math-verify reads.
TRL_RECORDS = [
    ("What is 1/3 of 1?", "math", r"\frac{1}{3}", [r"\boxed{\frac{1}{3}}", r"\boxed{\frac{1}{2}}"] * 2),
    ("Think, then 2 + 2.", "math", "4", ["<think>\nok\n</think>\n4", "4", "<think>x</think>", "5"]),
    ("Bad gold.", "math", r"\frac{", ["1", "2", "3", "4"]),  # TRL's accuracy_reward: None (skip)
]


def _prompt(text: str, chat: bool):
    return [{"role": "user", "content": text}] if chat else text


def _key(prompt) -> str:
    return prompt if isinstance(prompt, str) else prompt[-1]["content"]


def run_trl(tmp_path, monkeypatch, records, funcs, weights, *, chat: bool):
    """TRL's trainer on `records` for STEPS steps (every prompt each step); what its own code computed."""
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is experimental in TRL
    tokenizer = build_tokenizer()
    completions = {text: list(c) for text, _, _, c in records}
    dataset = Dataset.from_list(
        [{"prompt": _prompt(text, chat), "task": task, "solution": sol} for text, task, sol, _ in records]
    )

    def rollout(prompts, trainer):
        """TRL's hook for a custom generator: the fixed completions of each prompt, in order."""
        seen: dict[str, int] = {}
        prompt_ids, completion_ids = [], []
        for prompt in prompts:
            key = _key(prompt)
            j = seen[key] = seen.get(key, -1) + 1
            text = (
                prompt
                if isinstance(prompt, str)
                else tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
            )
            prompt_ids.append(tokenizer(text)["input_ids"])
            completion_ids.append(tokenizer(completions[key][j], add_special_tokens=False)["input_ids"])
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": None}

    n = len(records) * G
    args = GRPOConfig(
        output_dir=str(tmp_path / "trl"),
        per_device_train_batch_size=n,
        gradient_accumulation_steps=1,
        num_generations=G,
        max_completion_length=32,
        max_steps=STEPS,
        learning_rate=1e-6,
        scale_rewards="group",
        reward_weights=weights,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        use_cpu=True,
        bf16=False,
        shuffle_dataset=False,
        disable_tqdm=True,
        seed=0,
    )
    trainer = GRPOTrainer(
        model=build_model(tokenizer),
        reward_funcs=funcs,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        rollout_func=rollout,
    )
    scored, advantages = [], []
    calculate, generate_and_score = trainer._calculate_rewards, trainer._generate_and_score_completions

    def recorded_rewards(inputs, prompts, completions, completion_ids):
        per_function = calculate(inputs, prompts, completions, completion_ids)
        scored.append((inputs, prompts, completions, completion_ids, per_function.clone()))
        return per_function

    def recorded_output(inputs):
        output = generate_and_score(inputs)
        advantages.append(output["advantages"].clone())
        return output

    monkeypatch.setattr(trainer, "_calculate_rewards", recorded_rewards)
    monkeypatch.setattr(trainer, "_generate_and_score_completions", recorded_output)
    trainer.train()
    assert len(scored) == STEPS
    return scored, advantages


def grpo_run_scores(entries, scored, records):
    """grpo-run's RunScorer on what TRL's functions were given at each step: (ScoreResult, step) each."""
    cfg = RewardConfig(functions=entries)
    run = RunScorer(
        cfg,
        RewardPool(preload=()),
        report_errors=False,
        max_steps=STEPS,
        prompts_per_step=len(records),
        train_size=len(records),
    )
    results = []
    for step, (inputs, prompts, completions, completion_ids, _) in enumerate(scored, start=1):
        texts = [R._text(c) for c in completions]
        columns = {k: [row[k] for row in inputs] for k in inputs[0] if k not in ("prompt", "completion")}
        columns["completion_ids"] = [list(ids) for ids in completion_ids]
        inputs = UserInputs(
            prompts=list(prompts), columns=columns, step=step, trainer_state=run.trainer_state(step)
        )
        lengths = [len(ids) for ids in completion_ids]
        results.append(run([_key(p) for p in prompts], texts, [""] * len(texts), lengths, inputs))
    run.close()
    return results


def as_tensor(values) -> torch.Tensor:
    return torch.tensor([math.nan if v is None else v for v in values], dtype=torch.float32)


def assert_same(scored, advantages, results, names, weights):
    """Per function, the weighted totals and the group advantages, step by step."""
    w = torch.tensor(weights, dtype=torch.float32)
    for (_, _, _, _, trl_per_function), trl_advantages, ours in zip(scored, advantages, results, strict=True):
        for i, name in enumerate(names):
            torch.testing.assert_close(
                as_tensor(ours.per_function[name]), trl_per_function[:, i], equal_nan=True
            )
        # TRL's total: (rewards_per_func * weights).nansum(1), NaN where every function said None.
        trl_total = (trl_per_function * w).nansum(1)
        trl_total[torch.isnan(trl_per_function).all(1)] = math.nan
        torch.testing.assert_close(as_tensor(ours.total), trl_total, equal_nan=True)
        totals = as_tensor(ours.total).view(-1, G)  # [B, G]
        valid = ~torch.isnan(totals)
        ours_adv = compute_advantages(totals.nan_to_num(0.0), "normalized", "sample", 1e-4, valid=valid)
        torch.testing.assert_close(ours_adv.reshape(-1), trl_advantages, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("chat", [False, True], ids=["plain", "conversational"])
def test_multi_task_none_numpy_torch_async_and_trainer_state_equal_trls(tmp_path, monkeypatch, chat):
    names = ["math_task", "code_task", "numpy_length", "torch_has_digit", "async_exclaims", "progress"]
    weights = [1.0, 1.0, 0.5, 0.25, 2.0, 1.0]
    R.CALLS.clear()
    funcs = [getattr(R, name) for name in names]
    scored, advantages = run_trl(tmp_path, monkeypatch, RECORDS, funcs, weights, chat=chat)
    trl_states = [fields for name, fields in R.CALLS if name == "progress"]
    R.CALLS.clear()
    entries = [RewardFunctionConfig(_target_=f"{MODULE}.{n}", weight=w) for n, w in zip(names, weights)]
    results = grpo_run_scores(entries, scored, RECORDS)
    assert_same(scored, advantages, results, names, weights)
    ours_states = [fields for name, fields in R.CALLS if name == "progress"]
    # TRL's trainer_state at each step's scoring (global_step 0, then 1; epoch = prompts drawn / dataset)
    assert (
        trl_states
        == ours_states
        == [
            {"global_step": 0, "max_steps": 2, "epoch": 0.0, "num_train_epochs": 2},
            {"global_step": 1, "max_steps": 2, "epoch": 1.0, "num_train_epochs": 2},
        ]
    )
    # The "chat" row: every function but those that apply everywhere said None... here numpy, torch, async
    # and progress apply to it, so no completion is unscorable; the math rows' code value is None.
    assert all(r.unscorable == 0 and r.errors == 0 for r in results)
    math_rows = [i for i, row in enumerate(scored[0][0]) if row["task"] == "math"]
    assert all(results[0].per_function["code_task"][i] is None for i in math_rows)


def test_a_completion_every_function_says_none_for_is_unscorable_on_both_sides(tmp_path, monkeypatch):
    # Only the two task rewards: the "chat" row's completions get None from both.
    names, weights = ["math_task", "code_task"], [1.0, 1.0]
    scored, advantages = run_trl(
        tmp_path, monkeypatch, RECORDS, [R.math_task, R.code_task], weights, chat=False
    )
    entries = [RewardFunctionConfig(_target_=f"{MODULE}.{n}") for n in names]
    results = grpo_run_scores(entries, scored, RECORDS)
    assert_same(scored, advantages, results, names, weights)
    chat_rows = [i for i, row in enumerate(scored[0][0]) if row["task"] == "chat"]
    assert len(chat_rows) == G and results[0].unscorable == G  # TRL warns once; we count them
    assert all(results[0].total[i] is None for i in chat_rows)
    assert all(advantages[0][i] == 0 for i in chat_rows)  # TRL's own advantage for them: 0


def test_trls_shipped_reward_functions_run_unchanged_by_target(tmp_path, monkeypatch):
    from trl.rewards import accuracy_reward, get_soft_overlong_punishment, think_format_reward

    names = ["accuracy_reward", "think_format_reward", "overlong"]
    weights = [1.0, 0.5, 1.0]
    overlong = {"max_completion_len": 8, "soft_punish_cache": 4}
    funcs = [accuracy_reward, think_format_reward, get_soft_overlong_punishment(**overlong)]
    scored, advantages = run_trl(tmp_path, monkeypatch, TRL_RECORDS, funcs, weights, chat=True)
    entries = [
        RewardFunctionConfig(_target_="trl.rewards.accuracy_reward", weight=1.0),
        RewardFunctionConfig(_target_="trl.rewards.think_format_reward", weight=0.5),
        # a factory, as TRL's docs write it: called once with its kwargs, what it returns scores
        RewardFunctionConfig(
            _target_="trl.rewards.get_soft_overlong_punishment", name="overlong", kwargs=overlong
        ),
    ]
    results = grpo_run_scores(entries, scored, TRL_RECORDS)
    assert_same(scored, advantages, results, names, weights)
    bad_gold = [i for i, row in enumerate(scored[0][0]) if row["solution"] == r"\frac{"]
    assert all(results[0].per_function["accuracy_reward"][i] is None for i in bad_gold)  # TRL's "skip"
    assert results[0].errors == 0
