"""LazyEngine (grpo_run/rollout/engines.py): the trainer's engine under rollout=async, built only when
held-out evaluation first samples."""

import torch

from grpo_run.models.tiny import build_model, build_tokenizer
from grpo_run.rollout.engines import LazyEngine, TransformersEngine
from grpo_run.rollout.generate import SamplingParams


class Counting:
    """A real engine behind a counter of builds, updates and closes."""

    def __init__(self):
        self.builds = self.updates = self.closes = 0

    def build(self):
        self.builds += 1
        tok = build_tokenizer()
        inner = TransformersEngine(
            build_model(tok, seed=0), eos_id=tok.eos_token_id, pad_id=tok.pad_token_id, autocast_bf16=False
        )
        counter = self

        class Engine:
            def generate(self, *a, **kw):
                return inner.generate(*a, **kw)

            def policy_updated(self):
                counter.updates += 1

            def close(self):
                counter.closes += 1

        return Engine()


def test_nothing_is_built_until_the_first_generate_and_then_once():
    c = Counting()
    lazy = LazyEngine(c.build)
    lazy.policy_updated()  # a training step before any evaluation: nothing to sync
    assert (c.builds, c.updates, lazy.built) == (0, 0, False)
    ids, mask = torch.tensor([[5, 6, 7]]), torch.ones(1, 3, dtype=torch.long)
    first = lazy.generate(ids, mask, group_size=2, params=SamplingParams(3), seeds=[1])
    again = lazy.generate(ids, mask, group_size=2, params=SamplingParams(3), seeds=[1])
    assert c.builds == 1 and torch.equal(first.completion_ids, again.completion_ids)
    lazy.policy_updated()  # once built, every update reaches the engine
    assert c.updates == 1
    assert lazy.open_turns(ids, mask, group_size=2) is None  # this engine has no cached turns
    lazy.close()
    assert c.closes == 1


def test_closing_an_engine_never_built_builds_nothing():
    c = Counting()
    LazyEngine(c.build).close()
    assert c.builds == 0
