"""reasoning-gym as a source of verifiable tasks: its problems as Examples, its checkers as a reward."""

import pytest

from grpo_run.data.example import DataError
from grpo_run.data.reasoning_gym import reasoning_gym_splits
from grpo_run.rewards.reasoning_gym import final_answer, reasoning_gym_score
from grpo_run.scoring import RewardPool, RewardSpec, UserInputs, score

pytest.importorskip("reasoning_gym")


def test_final_answer_takes_the_last_box_then_the_answer_tag_then_the_last_line():
    assert final_answer(r"first \boxed{3}, then \boxed{ 4 }") == "4"
    assert final_answer(r"\boxed{} <answer> 12 </answer>") == "12"  # an empty box is no answer
    assert final_answer("thinking...\n\n  ainomma \n") == "ainomma"
    assert final_answer("") == ""


def splits(tasks, config=None, train=6, evaluation=3, seed=0):
    return reasoning_gym_splits(tasks, config or {}, seed=seed, train_size=train, eval_size=evaluation)


def test_splits_interleave_tasks_and_never_share_a_generated_index():
    train, held_out = splits(["leg_counting", "chain_sum"], train=5, evaluation=3)
    # shares: train 5 -> [3, 2], eval 3 -> [2, 1]; interleaved task by task
    assert [e.id for e in held_out] == ["leg_counting:eval:0", "chain_sum:eval:0", "leg_counting:eval:1"]
    assert [e.id.split(":")[0] for e in train] == ["leg_counting", "chain_sum"] * 2 + ["leg_counting"]
    indices = {
        (e.columns["metadata"]["source_dataset"], e.columns["metadata"]["source_index"]) for e in train
    }
    held = {
        (e.columns["metadata"]["source_dataset"], e.columns["metadata"]["source_index"]) for e in held_out
    }
    assert not indices & held
    assert all(e.columns["answer"] == e.answer and e.columns["question"] == e.question for e in train)


def test_the_same_seed_gives_the_same_problems_and_task_config_reaches_the_generator():
    a, _ = splits(["leg_counting"], {"leg_counting": {"min_animals": 1, "max_animals": 1}}, seed=3)
    b, _ = splits(["leg_counting"], {"leg_counting": {"min_animals": 1, "max_animals": 1}}, seed=3)
    assert [e.question for e in a] == [e.question for e in b]
    assert all(len(e.columns["metadata"]["animals"]) == 1 for e in a)


def test_unknown_tasks_and_bad_settings_name_themselves():
    with pytest.raises(DataError, match=r"unknown task\(s\) \['no_such_task'\]"):
        splits(["no_such_task"])
    with pytest.raises(DataError, match=r"data\.reasoning_gym\.config\.leg_counting=.*colour"):
        splits(["leg_counting"], {"leg_counting": {"colour": "red"}})
    with pytest.raises(DataError, match="tasks is empty"):
        splits([])


def test_each_task_is_scored_by_its_own_checker():
    train, _ = splits(["leg_counting", "spell_backward"], train=2, evaluation=0)
    legs, word = train
    completions = [rf"So \boxed{{{legs.answer}}}", "\\boxed{999999}", f"<answer>{word.answer}</answer>", "no"]
    rows = [legs, legs, word, word]
    values = reasoning_gym_score(
        [e.question for e in rows],
        completions,
        [e.answer for e in rows],
        metadata=[e.columns["metadata"] for e in rows],
        question=[e.question for e in rows],
        answer=[e.columns["answer"] for e in rows],
    )
    assert values[:3] == [1.0, 0.0, 1.0]
    assert 0 <= values[3] < 1  # spell_backward's checker gives partial credit by similarity


def test_a_record_without_reasoning_gym_metadata_is_unscorable():
    assert reasoning_gym_score(["q"], ["4"], ["4"], metadata=[{}]) == [None]


def test_the_registry_entry_runs_in_the_pool_with_the_columns():
    train, _ = splits(["chain_sum"], train=2, evaluation=0)
    completions = [rf"\boxed{{{train[0].answer}}}", r"\boxed{nope}"]
    columns = {key: [e.columns[key] for e in train] for key in ("question", "answer", "metadata")}
    with RewardPool(preload=()) as pool:
        result = score(
            [RewardSpec("reasoning_gym")],
            [e.question for e in train],
            completions,
            [e.answer for e in train],
            timeout_s=30,
            pool=pool,
            user_inputs=UserInputs(prompts=[e.question for e in train], columns=columns),
        )
    assert result.total == [1.0, 0.0] and result.errors == 0
