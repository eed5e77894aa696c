"""Real tiny judges that fail, for tests/rewards/test_model_rewards.py: the judge's model is loaded and
kept as usual, then its call raises, or sleeps past any budget a test gives. A module of its own, which
the judge's worker process imports by name."""

import time

from grpo_run.scoring.model_reward import ModelReward

HANG_S = 60.0


class RaisingJudge(ModelReward):
    def judge(self, frozen, prompts, completions, answers):
        raise RuntimeError("the judge failed")


class HangingJudge(ModelReward):
    def judge(self, frozen, prompts, completions, answers):
        time.sleep(HANG_S)
        return super().judge(frozen, prompts, completions, answers)
