"""Reward models and judges as reward entries, on the tiny model: a classification head built in code and
the tiny causal LM as judge; the verdict's arithmetic; the config's door; a judge that raises or hangs is
counted, never fatal."""

import dataclasses
import math
import os
import re
import time

import pytest
from omegaconf.errors import MissingMandatoryValue

from grpo_run.config.checks.reward import validate_reward_model
from grpo_run.config.schema import RewardFunctionConfig, RewardModelConfig, RewardModelKind
from grpo_run.config.validation import ConfigError
from grpo_run.models.frozen import FrozenSpec, Head, load_frozen
from grpo_run.models.loading import ModelLoadError
from grpo_run.models.tiny import ensure_tiny_model
from grpo_run.plan import inputs as plan_inputs
from grpo_run.rewards.extract import first_number
from grpo_run.rewards.verdict import number_verdict, template_fields, yes_probability
from grpo_run.scoring.dispatch import entry_pool, score
from grpo_run.scoring.model_reward import ModelReward, classifier_texts
from grpo_run.scoring.run_scorer import reward_specs
from grpo_run.scoring.tally import RewardSpec
from tests.builders import compose_config, folder_with_own_code, tiny_classifier
from tests.rewards.faulty_judges import HANG_S, HangingJudge, RaisingJudge

CLASSIFIER, JUDGE = RewardModelKind.CLASSIFIER, RewardModelKind.JUDGE
# a plain question, another, and a conversation with a system turn (TRL's conversational prompt)
PROMPTS = [
    "What is 2 + 3?",
    "What is 10 - 4?",
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 7 + 7?"}],
]
COMPLETIONS = ["5", "The answer is \\boxed{6}.", "aaaa"]
ANSWERS = ["5", "6", "14"]


@pytest.fixture(scope="module")
def rm_path(tmp_path_factory) -> str:
    return str(tiny_classifier(tmp_path_factory.mktemp("rm") / "rm"))


@pytest.fixture(scope="module")
def judge_path() -> str:
    return str(ensure_tiny_model(os.environ["GRPO_RUN_CACHE"]))


def one_at_a_time(reward: ModelReward) -> list:
    return [reward([p], [c], [a])[0] for p, c, a in zip(PROMPTS, COMPLETIONS, ANSWERS, strict=True)]


def test_a_classifier_scores_a_batch_as_it_scores_each_completion_alone(rm_path):
    rm = ModelReward(FrozenSpec(rm_path), CLASSIFIER)
    batch = rm(PROMPTS, COMPLETIONS, ANSWERS)
    assert batch == pytest.approx(one_at_a_time(rm), abs=1e-5)
    assert all(math.isfinite(v) for v in batch)
    assert len({round(v, 6) for v in batch}) == 3  # each reads its own completion


def test_the_classifier_reads_the_conversation_in_its_chat_template_else_plain_text(rm_path):
    tokenizer = load_frozen(FrozenSpec(rm_path), Head.SEQUENCE_CLASSIFIER).tokenizer
    texts, templated = classifier_texts(tokenizer, PROMPTS[1:], COMPLETIONS[1:])
    assert templated and texts == [
        "<|im_start|>user\nWhat is 10 - 4?<|im_end|>\n<|im_start|>assistant\nThe answer is \\boxed{6}.<|im_end|>\n",
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 7 + 7?<|im_end|>\n"
        "<|im_start|>assistant\naaaa<|im_end|>\n",
    ]
    tokenizer.chat_template = None
    assert classifier_texts(tokenizer, PROMPTS[1:], COMPLETIONS[1:]) == (
        ["What is 10 - 4?\nThe answer is \\boxed{6}.", "Be brief.\nWhat is 7 + 7?\naaaa"],
        False,
    )


def test_a_judges_yes_probability_is_p_yes_over_p_yes_plus_p_no_and_batches_alike(judge_path):
    spec = FrozenSpec(judge_path)
    judge = ModelReward(spec, JUDGE)
    values = judge(PROMPTS, COMPLETIONS, ANSWERS)
    assert values == pytest.approx(one_at_a_time(judge), abs=1e-6)
    assert all(0 < v < 1 for v in values)
    # the same judge asked for each answer's raw probability
    p_yes = ModelReward(spec, JUDGE, {"no_text": None})(PROMPTS, COMPLETIONS, ANSWERS)
    p_no = ModelReward(spec, JUDGE, {"yes_text": "No", "no_text": None})(PROMPTS, COMPLETIONS, ANSWERS)
    assert values == pytest.approx([y / (y + n) for y, n in zip(p_yes, p_no, strict=True)], rel=1e-5)


def test_yes_probability_worked_numbers():
    # P(yes) = 0.6, P(no) = 0.2: 0.6 / (0.6 + 0.2) = 0.75
    assert yes_probability(math.log(0.6), math.log(0.2)) == pytest.approx(0.75)
    # without a "no": P(yes) itself
    assert yes_probability(math.log(0.3), None) == pytest.approx(0.3)
    # both far below float range: 1 / (1 + e^(-1001 + 1000)) = 1 / (1 + e^-1) = 0.7311, not 0/0
    assert yes_probability(-1000.0, -1001.0) == pytest.approx(0.7311, abs=1e-4)


@pytest.mark.parametrize(
    "reply,value",
    [
        ("8", 8.0),
        ("Score: 7/10. Good answer, 3 steps", 7.0),  # the first number; a ratio counts as its numerator
        ("-2.5 points", -2.5),
        ("1,234 out of 2,000", 1234.0),
        ("I cannot tell", None),  # unscorable: the judge's failure, not the completion's
    ],
)
def test_a_number_verdict_is_the_first_number_of_the_reply(reply, value):
    assert number_verdict(reply) == value


def test_first_number_and_template_fields():
    assert first_number("x2 is not one, 3.5 is, then 7") == "3.5"
    assert template_fields("Q: {question} A: {completion}") == ["question", "completion"]


def model_entry(kind: str, extra: str = "", path: str = "org/model") -> str:
    return f"reward.functions=[{{model: {{path: {path}, kind: {kind}}}{extra}}}]"


def test_an_entry_without_a_name_is_named_for_its_kind_at_the_door():
    cfg = compose_config(["reward.functions=[{model: {path: org/rm}}, {model: {path: x/j, kind: judge}}]"])
    assert [fn.name for fn in cfg.reward.functions] == ["reward_model", "judge"]


def entry(kind=CLASSIFIER, path="org/model", **fields) -> RewardFunctionConfig:
    return RewardFunctionConfig(model=RewardModelConfig(path=path, kind=kind), **fields)


@pytest.mark.parametrize(
    "fn,key",
    [
        (entry(_target_="my.fn"), "reward.functions[0]._target_"),
        (entry(kwargs={"template": "x"}), "reward.functions[0].kwargs"),
        (entry(JUDGE, kwargs={"temperature": 0.5}), "reward.functions[0].kwargs.temperature"),
        (entry(JUDGE, kwargs={"template": "Is {question} right?"}), "reward.functions[0].kwargs.template"),
        (
            entry(JUDGE, kwargs={"template": "Grade {completion} by {rubric}"}),
            "reward.functions[0].kwargs.template",
        ),
        (entry(JUDGE, kwargs={"verdict": "score"}), "reward.functions[0].kwargs.verdict"),
        (entry(JUDGE, kwargs={"no_text": "Yes"}), "reward.functions[0].kwargs.no_text"),
        (entry(JUDGE, isolated=True), "reward.functions[0].isolated"),
        (entry(path="/no/such/folder"), "reward.functions[0].model.path"),
        (
            RewardFunctionConfig(model=RewardModelConfig(path="org/rm", device="gpu")),
            "reward.functions[0].model.device",
        ),
    ],
)
def test_a_bad_model_entry_is_a_config_error_naming_the_key(fn, key):
    with pytest.raises(ConfigError, match=re.escape(key + "=")):
        validate_reward_model(fn, "reward.functions[0]")


def test_a_preset_without_its_path_names_the_missing_key():
    with pytest.raises(MissingMandatoryValue, match=r"reward\.functions\[0\]\.model\.path"):
        compose_config(["model=tiny", "reward=judge"])


def test_a_model_folder_with_its_own_code_is_refused(tmp_path):
    folder, marker = folder_with_own_code(tmp_path, model_type="only_its_code_knows")
    with pytest.raises(ModelLoadError, match="trust_remote_code"):
        load_frozen(FrozenSpec(str(folder)), Head.CAUSAL_LM)
    assert not marker.exists()


def faulty(entry, cls):
    """The entry with its judge replaced by `cls` (the same spec and options: the same model)."""
    judge = cls(entry.fn.spec, entry.fn.kind, entry.fn.options, key=entry.fn.key)
    return dataclasses.replace(entry, fn=judge, prepare=judge.prepare)


def test_a_judge_that_raises_or_hangs_is_counted_and_never_fatal(judge_path):
    cfg = compose_config(
        ["model=tiny", f"reward.functions=[{{name: judge, model: {{path: {judge_path}, kind: judge}}}}]"]
    )
    entry = reward_specs(cfg.reward)[0].entry
    pool = entry_pool(entry)  # one worker: the judge's model is loaded there once, off the budget clock
    try:
        raising = [RewardSpec("judge", 1.0, {}, faulty(entry, RaisingJudge)), RewardSpec("format", 0.5)]
        result = score(raising, PROMPTS, COMPLETIONS, ANSWERS, timeout_s=60, pools={"judge": pool})
        # the batch raised, then each completion alone: three errors, and no score (a 0 would be a
        # judgement the judge never made); format's values are kept, the totals are unscorable
        assert (result.errors, result.errors_by_function["judge"], result.timeouts) == (3, 3, 0)
        assert result.per_function["judge"] == [None, None, None] and result.unscorable == 3
        assert result.per_function["format"] == [0.0, 1.0, 0.0]
        assert result.total == [None, None, None] and "the judge failed" in result.first_error
        hanging = [RewardSpec("judge", 1.0, {}, faulty(entry, HangingJudge))]
        started = time.monotonic()
        result = score(hanging, PROMPTS, COMPLETIONS, ANSWERS, timeout_s=1.0, pools={"judge": pool})
        assert time.monotonic() - started < HANG_S / 4  # abandoned at its budget, its worker killed
        assert (result.timeouts, result.timeouts_by_function["judge"], result.errors) == (3, 3, 0)
        assert result.total == [None, None, None] and result.unscorable == 3
    finally:
        pool.close()


def test_plan_names_each_reward_model_and_counts_those_on_its_device(rm_path, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))  # offline and empty: the hub id is unknown
    rewards = (
        f"reward.functions=[{{name: rm, model: {{path: {rm_path}}}}}, {{name: gpu_rm, model: {{path: {rm_path},"
        " device: 'cuda:1'}}, {name: judge, model: {path: org/judge, kind: judge}}]"
    )
    cfg = compose_config(["mode=plan", "model=tiny", "trainer.device=cpu", rewards])
    size, lines = plan_inputs.reward_models(cfg, plan_inputs.Device("cpu", 2**30, "test"))
    # the tiny body (tied embedding counted once) and a 48-wide head of one label, float32
    classifier = load_frozen(FrozenSpec(rm_path), Head.SEQUENCE_CLASSIFIER).model
    assert size == 4 * sum(p.numel() for p in classifier.parameters())  # only the one on this device
    assert lines[0].startswith(
        f"reward.functions[0]: classifier {rm_path} (float32) in a worker of its own on cpu"
    )
    assert lines[1].endswith("not on this device") and "unknown" in lines[2]
