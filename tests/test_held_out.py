"""StepLog (grpo_run/held_out.py): step rows go out in step order, each with its evaluation once it came."""

from grpo_run.held_out import StepLog


class LateEvals:
    """An evaluation that finishes when the test says so (as the generation worker's do, steps later)."""

    def __init__(self) -> None:
        self.started: list[int] = []
        self.finished: dict[int, dict[str, float]] = {}

    def start(self, step: int) -> bool:
        self.started.append(step)
        return True

    def results(self, *, wait: bool) -> dict[int, dict[str, float]]:
        if wait:  # every started one
            for step in self.started:
                self.finished.setdefault(step, {"eval/accuracy": step / 10})
        done = {s: v for s, v in self.finished.items() if s in self.started}
        self.started = [s for s in self.started if s not in done]
        self.finished = {}
        return done


def test_rows_wait_for_their_evaluation_and_keep_step_order():
    logged: list[tuple[int, dict]] = []
    evals: dict[int, dict[str, float]] = {}
    late = LateEvals()
    log = StepLog(lambda step, row: logged.append((step, dict(row))), late, evals)
    log.add(0, {}, evaluate=True)  # step 0: evaluation only, on its way
    log.add(1, {"loss": 1.0}, evaluate=False)
    assert logged == []  # step 1 waits behind step 0
    late.finished[0] = {"eval/accuracy": 0.25}
    log.add(2, {"loss": 2.0}, evaluate=True)
    assert logged == [(0, {"eval/accuracy": 0.25}), (1, {"loss": 1.0})]  # step 2 awaits its own
    log.flush(wait=True)
    assert logged[2] == (2, {"loss": 2.0, "eval/accuracy": 0.2})  # 2 / 10, merged into the row
    assert evals == {0: {"eval/accuracy": 0.25}, 2: {"eval/accuracy": 0.2}}  # the final report's


def test_a_run_that_ends_early_still_logs_its_rows_without_the_missing_evaluation():
    logged: list[int] = []
    log = StepLog(lambda step, row: logged.append(step), LateEvals(), {})
    log.add(0, {}, evaluate=True)
    log.add(1, {"loss": 1.0}, evaluate=True)
    log.abandon()
    assert logged == [1]  # the empty step-0 row (an evaluation that never came) is not logged
