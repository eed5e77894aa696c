"""Reliability and security, second round (docs/reliability.md): every bad input, foreign file and
outside fault below reaches the real `grpo-run` command, which names the key, file or process involved."""

import contextlib
import json
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

import grpo_run.trainer as trainer
from grpo_run import checkpoint
from grpo_run import metrics as M
from grpo_run.safety.signals import EXIT_PREEMPTED
from tests.builders import (
    LEARN,
    alive,
    config,
    descendants,
    folder_with_own_code,
    inject_nan_loss,
    run_here,
)
from tests.helpers import FAST, GRPO_RUN, REPO, read_metrics, run_cli

QUIET = ["logger=console", "logger.console=false"]
REWARD_HOOKS = str(Path(__file__).parent / "reward_hooks")


def last_line(proc) -> str:
    return (proc.stdout + proc.stderr).strip().splitlines()[-1]


def test_cuda_without_a_gpu_exits_2_naming_the_key_and_what_torch_sees(tmp_path):
    # CUDA_VISIBLE_DEVICES="" hides any GPU, so this holds on a GPU machine too.
    proc, run_dir = run_cli(
        [*FAST, *QUIET, "trainer.device=cuda"], tmp_path, check=False, env={"CUDA_VISIBLE_DEVICES": ""}
    )
    assert proc.returncode == 2, proc.stderr
    assert "trainer.device='cuda'" in proc.stderr
    assert "torch sees no CUDA device" in proc.stderr
    assert not (run_dir / "config_resolved.yaml").exists()  # nothing ran


def test_the_nan_stop_says_what_checkpoint_exists(tmp_path, monkeypatch):
    """With no checkpoint saved yet, the message says so instead of promising finite weights."""
    inject_nan_loss(monkeypatch, lambda step: step >= 1)
    overrides = [*LEARN, "trainer.max_steps=4", "trainer.max_consecutive_nonfinite=2"]
    with pytest.raises(trainer.NonFiniteError, match="no checkpoint was saved") as err:
        trainer.train(config(overrides, tmp_path / "none"))
    assert "holds finite weights" not in str(err.value)
    saved = [*overrides, "checkpoint.every_steps=1", "trainer.max_consecutive_nonfinite=3"]
    # Steps 1-3 NaN (still injected): steps 1 and 2 are saved (streaks 1, 2), step 3 stops unsaved.
    with pytest.raises(trainer.NonFiniteError, match=r"step_00000002 \(step 2\), holds finite weights"):
        trainer.train(config(saved, tmp_path / "saved"))


# ------------------------------------------------------------------------------------------- security


def foreign_code_folder(tmp_path: Path) -> tuple[Path, Path]:
    """A model folder whose config names its own Python under an unknown model_type (transformers then
    asks on stdin whether to run it); importing that Python would write `marker`."""
    folder, marker = tmp_path / "foreign", tmp_path / "foreign-code-ran"
    folder.mkdir()
    auto_map = {"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel"}
    config = {"model_type": "grpo_run_unknown_arch", "auto_map": auto_map}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"auto_map": {"AutoTokenizer": ["evil.Tok", None]}})
    )
    (folder / "evil.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    return folder, marker


@pytest.mark.parametrize("where", ["model.path", "eval.checkpoint", "mode=plan"])
def test_a_model_folders_own_code_never_runs_and_nothing_prompts(tmp_path, where):
    folder, marker = foreign_code_folder(tmp_path)
    target = (
        ["model=pretrained", f"model.path={folder}"]
        if where == "model.path"
        else ["mode=plan", "model=pretrained", f"model.path={folder}"]
        if where == "mode=plan"
        else ["mode=eval", f"eval.checkpoint={folder}", "eval.num_prompts=2"]
    )
    args = [GRPO_RUN, *FAST, *QUIET, *target, f"hydra.run.dir={tmp_path / 'run'}"]
    # A "y" waits on stdin: before the fix, transformers read it and imported evil.py.
    proc = subprocess.run(args, cwd=REPO, input="y\ny\ny\n", capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert not marker.exists()
    assert "[y/N]" not in proc.stdout + proc.stderr
    assert str(folder.resolve()) in last_line(proc) and "model.trust_remote_code=true" in last_line(proc)
    assert "config.json auto_map" in last_line(proc) and "'grpo_run_unknown_arch'" in last_line(proc)


def test_a_known_model_type_with_its_own_code_trains_on_the_built_in_classes(tmp_path):
    """The tiny model's folder (model_type qwen2) with an auto_map in config.json and tokenizer_config.json:
    the run trains on transformers' own Qwen2 (the folder's Python never runs, nothing prompts, a piped
    "y" does nothing) and the log says once that the folder's code was ignored."""
    folder, marker = folder_with_own_code(tmp_path)
    args = [
        GRPO_RUN,
        *FAST,
        *QUIET,
        "model=pretrained",
        f"model.path={folder}",
        f"hydra.run.dir={tmp_path / 'run'}",
    ]
    proc = subprocess.run(args, cwd=REPO, input="y\ny\ny\n", capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not marker.exists()
    assert "[y/N]" not in proc.stdout + proc.stderr
    said = [line for line in (proc.stdout + proc.stderr).splitlines() if "is ignored" in line]
    assert len(said) == 1 and str(folder.resolve()) in said[0] and "auto_map" in said[0], said
    assert [row["step"] for row in read_metrics(tmp_path / "run")] == [1, 2]


def test_trust_remote_code_is_an_explicit_opt_in_key_off_by_default(tmp_path):
    cfg = config([*FAST, *QUIET], tmp_path / "run")
    assert cfg.model.trust_remote_code is False
    assert config([*FAST, "model.trust_remote_code=true"], tmp_path / "run").model.trust_remote_code


# ------------------------------------------------------------------------------------------ processes


def start_run(args: list[str], run_dir: Path, stdout_to=subprocess.PIPE, **kwargs) -> subprocess.Popen:
    return subprocess.Popen(
        [GRPO_RUN, *args, f"hydra.run.dir={run_dir}"],
        cwd=REPO,
        stdout=stdout_to,
        stderr=stdout_to,
        text=True,
        **kwargs,
    )


def wait_for(condition, timeout: float = 120, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_one_run_per_run_dir_and_a_dead_holders_lock_is_taken_over(tmp_path):
    """A second `grpo-run` on a held run dir fails at once naming the dir and the holder's pid; after the
    holder is SIGKILLed its lock is free. (The holder takes the lock as `grpo-run` does, then sleeps,
    which keeps a loaded machine free for the runs under test.)"""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    hold = f"from grpo_run.safety.run_lock import hold_run_dir; from pathlib import Path; import time; hold_run_dir(Path({str(run_dir)!r})); print('held', flush=True); time.sleep(600)"
    holder = subprocess.Popen([sys.executable, "-c", hold], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        second, _ = run_cli([*FAST, *QUIET], tmp_path, check=False, timeout=120)
        assert second.returncode == 1
        assert f"run dir {run_dir} is in use by another grpo-run (pid {holder.pid})" in last_line(second)
        assert not (run_dir / "metrics.jsonl").exists()  # it stopped before writing anything
    finally:
        holder.kill()
        holder.communicate()
    assert (run_dir / "run.lock").read_text().strip() == str(holder.pid)  # left behind, but unlocked
    run_cli([*FAST, *QUIET, "trainer.max_steps=1"], tmp_path)
    again, _ = run_cli([*FAST, *QUIET, "trainer.max_steps=1", "resume=auto"], tmp_path)  # a finished run
    assert "nothing to do" in again.stdout + again.stderr  # exit 0 (run_cli checks it), the lock taken over


def test_a_refused_second_run_leaves_the_holders_files_byte_identical(tmp_path):
    """The lock is taken before Hydra writes `.hydra/` and its log: the holder's files stay as they were."""
    run_dir = tmp_path / "run"
    (run_dir / ".hydra").mkdir(parents=True)
    for name in ("config.yaml", "hydra.yaml", "overrides.yaml"):
        (run_dir / ".hydra" / name).write_text(f"the holder's {name}\n")
    hold = f"from grpo_run.safety.run_lock import hold_run_dir; from pathlib import Path; import time; hold_run_dir(Path({str(run_dir)!r})); print('held', flush=True); time.sleep(600)"
    holder = subprocess.Popen([sys.executable, "-c", hold], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
        second, _ = run_cli([*FAST, *QUIET, "trainer.max_steps=7"], tmp_path, check=False, timeout=120)
        after = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    finally:
        holder.kill()
        holder.communicate()
    assert second.returncode == 1
    assert f"is in use by another grpo-run (pid {holder.pid})" in last_line(second)
    assert after == before  # no .hydra/ rewritten (max_steps=7 would show), no log file opened


# math_verifier runs in the worker pool; target_char_fraction beside it gives the groups unequal rewards,
# so steps 1-2 update the weights and Adam state that the stop must save.
BOTH_REWARDS = "reward.functions=[{name:target_char_fraction,kwargs:{target:a}},{name:math_verifier}]"
DIES_AT_STEP_3 = [*FAST, *QUIET, BOTH_REWARDS, "trainer.max_steps=3", "checkpoint.every_steps=0"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    """DIES_AT_STEP_3 with nothing failing (trained in this process): the run each fault is compared with."""
    return run_here(DIES_AT_STEP_3, tmp_path_factory.mktemp("whole") / "run")


def test_unscorable_rewards_leave_the_step_untrained_and_save_the_last_good_state(tmp_path, uninterrupted):
    """Steps 1-2 score 8 completions each (B = 2, G = 4); at step 3 the workers keep dying. The run stops
    with step 3 untrained and saves step 2's state (no checkpoint was due), and a resume with the reward
    fixed gives the metrics of an uninterrupted run, step 3 included."""
    counter = tmp_path / "reward-calls"
    env = {
        "PYTHONPATH": os.pathsep.join(p for p in [REWARD_HOOKS, os.environ.get("PYTHONPATH")] if p),
        "GRPO_TEST_REWARD_CALLS": str(counter),
        "GRPO_TEST_KILL_AFTER": "16",
    }
    proc, run_dir = run_cli(DIES_AT_STEP_3, tmp_path / "stopped", check=False, env=env)
    assert proc.returncode == 1, proc.stderr
    step_2 = run_dir / "checkpoints" / "step_00000002"
    assert last_line(proc) == (
        "grpo-run: step 3 was not trained: reward workers for grpo_run.rewards.functions.math_verifier died "
        f"3 times in a row; the last good state, {step_2} (step 2), is saved; resume with resume=auto"
    )
    assert counter.read_text() == "16"  # the hook did score steps 1 and 2
    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2]
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_00000002"
    run_cli([*DIES_AT_STEP_3, "resume=auto"], tmp_path / "stopped")  # the reward works again
    assert without_timings(read_metrics(run_dir)) == without_timings(read_metrics(uninterrupted))


def without_timings(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if not k.startswith("perf/")} for row in rows]


MATH = ["reward=math_verifier", "trainer.max_steps=100000"]


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads /proc")
def test_sigkill_of_the_trainer_leaves_no_reward_worker_or_resource_tracker(tmp_path):
    # No pipes: an orphaned worker would hold them open, and reading them would wait on it.
    args = [*FAST, *QUIET, *MATH]
    trainer_proc = start_run(args, tmp_path / "run", stdout_to=subprocess.DEVNULL)
    children: set[int] = set()
    try:
        # The math-verify worker (and the resource tracker beside it) start at the first scoring.
        wait_for(lambda: len(descendants(trainer_proc.pid)) >= 2, timeout=240, what="the reward worker")
        time.sleep(1.0)
        children = descendants(trainer_proc.pid)
        trainer_proc.kill()
        trainer_proc.wait()
        wait_for(lambda: not any(alive(pid) for pid in children), timeout=10, what=f"{children} to exit")
    finally:
        trainer_proc.kill()
        for pid in children | descendants(trainer_proc.pid):
            if alive(pid):  # only after a failure: the orphans this test is about
                os.kill(pid, signal.SIGKILL)


def test_sigterm_to_the_process_group_while_the_worker_starts_never_scores_errors(tmp_path):
    """Slurm signals every process of the job: the worker, still starting, ignores it (it is not counted
    as a dead worker or a reward error); the trainer abandons the step it was scoring, the first, so
    nothing is logged or saved, and exits 75."""
    run_dir = tmp_path / "run"
    args = [*FAST, *QUIET, *MATH, "data.train_size=64"]
    trainer_proc = start_run(args, run_dir, stdout_to=subprocess.DEVNULL, start_new_session=True)
    try:

        def worker_started() -> bool:
            for pid in descendants(trainer_proc.pid):
                with contextlib.suppress(OSError):
                    if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
                        return True
            return False

        wait_for(worker_started, timeout=240, what="the reward worker")
        os.killpg(trainer_proc.pid, signal.SIGTERM)
        assert trainer_proc.wait(timeout=240) == EXIT_PREEMPTED
    finally:
        trainer_proc.kill()
    assert not (run_dir / "metrics.jsonl").exists() or read_metrics(run_dir) == []
    assert not (run_dir / "checkpoints" / "latest").exists()


# ------------------------------------------------------------------------------------------- bad input


def jsonl(path: Path, questions: list[str]) -> Path:
    path.write_text("".join(json.dumps({"question": q, "answer": "2"}) + "\n" for q in questions))
    return path


def test_prompts_longer_than_the_model_fail_naming_the_record_or_are_skipped_and_counted(tmp_path):
    # Record 2's prompt alone is past the tiny model's 1,024 positions (~2,000 tokens).
    data = jsonl(tmp_path / "train.jsonl", ["1 + 1", "1 + 1 " * 1000, "2 + 0"])
    args = [*FAST, *QUIET, "data=jsonl", f"data.train_path={data}", "trainer.max_steps=1"]
    proc, run_dir = run_cli(args, tmp_path / "fail", check=False)
    assert proc.returncode == 1
    line = last_line(proc)
    assert f"data.train_path={data}" in line and "record train:2 has" in line
    assert "data.max_prompt_tokens=1016" in line  # 1,024 positions - 8 new tokens
    assert not (run_dir / "metrics.jsonl").exists()
    proc, run_dir = run_cli([*args, "data.max_prompt_tokens=100"], tmp_path / "skip")
    out = proc.stdout + proc.stderr
    assert "skipped 1 of 3 train records" in out and "the first: record train:2" in out


def test_prompts_too_long_in_mode_eval_and_in_eval_datasets_are_named_or_skipped(tmp_path):
    """The same check for the held-out files: mode=eval's own split, and each eval.datasets set under
    its own keys (eval.max_new_tokens = 8 leaves 1,016 of the tiny model's 1,024 positions)."""
    train = jsonl(tmp_path / "train.jsonl", ["1 + 1", "2 + 0", "3 + 1"])
    held_out = jsonl(tmp_path / "eval.jsonl", ["1 + 1", "1 + 1 " * 1000])
    files = ["data=jsonl", f"data.train_path={train}"]
    proc, run_dir = run_cli(
        [*FAST, *QUIET, *files, "mode=eval", f"data.eval_path={held_out}"], tmp_path / "eval", check=False
    )
    assert proc.returncode == 1
    line = last_line(proc)
    assert f"data.eval_path={held_out}: 1 of 2 records" in line and "record eval:2 has" in line
    assert "eval.max_new_tokens=8" in line and "data.max_prompt_tokens=1016" in line
    assert not (run_dir / "eval_summary.json").exists()
    extra = ["+data@eval.datasets.long=jsonl", f"eval.datasets.long.eval_path={held_out}"]
    args = [*FAST, *QUIET, *files, *extra, "trainer.max_steps=1"]
    proc, run_dir = run_cli(args, tmp_path / "train", check=False)
    assert proc.returncode == 1
    line = last_line(proc)
    assert f"eval.datasets.long.eval_path={held_out}: 1 of 2 records" in line and "record eval:2" in line
    assert "set eval.datasets.long.max_prompt_tokens=1016" in line
    assert not (run_dir / "metrics.jsonl").exists()
    proc, _ = run_cli([*args, "eval.datasets.long.max_prompt_tokens=100"], tmp_path / "skip")
    out = (proc.stdout + proc.stderr).replace("\n", "")
    assert f"skipped 1 of 2 eval records of eval.datasets.long.eval_path={held_out}" in out
    assert "the first: record eval:2" in out


def test_too_few_records_for_a_step_name_the_file_the_count_and_the_key(tmp_path):
    data = jsonl(tmp_path / "train.jsonl", ["1 + 1", "2 + 0", "3 + 1"])
    args = [*FAST, *QUIET, "data=jsonl", f"data.train_path={data}", "trainer.prompts_per_step=4"]
    proc, _ = run_cli(args, tmp_path, check=False)
    assert proc.returncode == 1
    assert f"data.train_path={data}: 3 usable training records, fewer than trainer.prompts_per_step=4" in (
        last_line(proc)
    )


def test_a_read_only_run_dir_ends_in_one_line_naming_the_folder_and_the_cause(tmp_path):
    # Outside pytest's tmp folder, which only its owner may enter.
    run_dir = Path(tempfile.mkdtemp(prefix="grpo-run-read-only-")) / "locked"
    run_dir.mkdir(mode=0o555)
    run_dir.parent.chmod(0o755)
    # As an unprivileged user: root writes through permission bits.
    drop = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"] if os.geteuid() == 0 else []
    if drop and shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv: a read-only folder is writable to root")
    args = [*drop, GRPO_RUN, *FAST, *QUIET]
    proc = subprocess.run(
        [*args, f"hydra.run.dir={run_dir}"], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 1
    assert last_line(proc) == f"grpo-run: cannot write the run dir {run_dir}: Permission denied ({run_dir})"
    shutil.rmtree(run_dir.parent)


@contextlib.contextmanager
def small_filesystem(size: str):
    """A tmpfs of `size` (root, where mounting is permitted), unmounted afterwards."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("a full disk needs a small tmpfs: mounting one needs root")
    folder = Path(tempfile.mkdtemp(prefix="grpo-run-small-fs-"))
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        folder.rmdir()
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)
        folder.rmdir()


def test_a_disk_full_during_a_save_keeps_the_previous_checkpoint_and_names_the_folder(tmp_path):
    """2 MiB: the run's files and step 1's checkpoint (1.3 MB) fit; step 2's optimizer.pt does not."""
    with small_filesystem("2m") as disk:
        run_dir = disk / "run"
        args = [*FAST, *QUIET, "checkpoint.every_steps=1", f"hydra.run.dir={run_dir}"]
        proc, _ = run_cli(args, tmp_path, check=False)
        assert proc.returncode == 1, proc.stderr
        root = run_dir / "checkpoints"
        line = last_line(proc)
        assert line.startswith(
            f"grpo-run: {root / '.tmp-step_00000002'}: the checkpoint of step 2 could not be written: "
            "No space left on device ("
        )
        assert line.endswith(
            f"; the last checkpoint, {root / 'step_00000001'} (step 1), holds finite weights"
        )
        assert (root / "latest").read_text() == "step_00000001\n"
        assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000001"]  # nothing half-written
        assert checkpoint.damage(root / "step_00000001") is None  # its manifest still matches every file
        assert [r["step"] for r in read_metrics(run_dir)] == [1, 2]


def test_a_missing_or_pickled_checkpoint_file_is_named_in_the_last_line(tmp_path):
    args = [*FAST, *QUIET, "trainer.max_steps=1"]
    run_dir = run_here(args, tmp_path / "run")
    resume = [*args, "trainer.max_steps=2", "resume=auto"]
    folder = run_dir / "checkpoints" / "step_00000001"
    rng = folder / "rng_rank0.pt"
    rng.unlink()
    proc, _ = run_cli(resume, tmp_path, check=False)  # the manifest finds it missing
    assert proc.returncode == 1
    assert last_line(proc).endswith(f"the newest: {rng}: missing")
    (folder / "manifest.json").unlink()  # as a checkpoint saved before manifests existed
    proc, _ = run_cli(resume, tmp_path, check=False)
    assert proc.returncode == 1
    assert last_line(proc) == f"grpo-run: {rng}: No such file or directory"
    # A pickle that would run code on load (os.system): refused and named, never run.
    marker = tmp_path / "pickle-ran"
    rng.write_bytes(pickle.dumps(RunsCode(str(marker))))
    proc, _ = run_cli(resume, tmp_path, check=False)
    assert proc.returncode == 1 and not marker.exists()
    assert last_line(proc).startswith(f"grpo-run: {folder}: a file there holds a pickle that torch.load")


class RunsCode:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_secret_in_a_bad_override_reaches_neither_the_console_nor_a_file(tmp_path):
    """Hydra echoes an override it cannot parse: the W&B-shaped key in it is redacted on stderr too."""
    key = uuid.uuid4().hex + uuid.uuid4().hex[:8]
    proc, run_dir = run_cli(
        [*FAST, f"logger.tags=[{key}"], tmp_path, check=False, env={"HYDRA_FULL_ERROR": "1"}
    )
    assert proc.returncode == 2
    assert "no viable alternative at input '[<redacted>'" in proc.stdout + proc.stderr
    assert key not in proc.stdout + proc.stderr
    written = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert [p for p in written if key.encode() in p.read_bytes()] == []


def test_secrets_passed_as_override_values_reach_no_file_of_the_run(tmp_path):
    """The W&B key (from the environment) and an HF-token-shaped value given on the command line: not in
    Hydra's .hydra/*.yaml, config_resolved.yaml, the log, or the offline .wandb file's args/config."""
    key = uuid.uuid4().hex + uuid.uuid4().hex[:8]  # 40 hex digits, a W&B key's shape
    token = "hf_" + uuid.uuid4().hex + "ABCD"
    env = {"WANDB_API_KEY": key, "WANDB_MODE": "offline"}
    args = [*FAST, "logger=wandb", "logger.console=false", "trainer.max_steps=1"]
    _, run_dir = run_cli([*args, f"logger.tags=[{key}]", f"logger.name={token}"], tmp_path, env=env)
    written = [p for p in run_dir.rglob("*") if p.is_file()]
    assert any(p.suffix == ".wandb" for p in written) and (run_dir / ".hydra" / "overrides.yaml").exists()
    leaks = [p for p in written if key.encode() in p.read_bytes() or token.encode() in p.read_bytes()]
    assert leaks == []
    assert "<redacted>" in (run_dir / ".hydra" / "overrides.yaml").read_text()
    assert "max_new_tokens: 8" in (run_dir / "config_resolved.yaml").read_text()  # ordinary keys are kept
    assert "generation.max_new_tokens=8" in (run_dir / ".hydra" / "overrides.yaml").read_text()


# ---------------------------------------------------------------------------------------------- resume


def test_a_key_changed_on_resume_is_applied_or_refused_by_name(tmp_path):
    args = [*FAST, *QUIET, "trainer.max_steps=1", "trainer.lr=1e-3"]
    run_cli(args, tmp_path)  # the command's own config (its W&B tags too): only the keys below change
    proc, run_dir = run_cli(
        [*args, "resume=auto", "trainer.max_steps=2", "grpo.group_size=2"], tmp_path, check=False
    )
    assert proc.returncode == 2
    line = last_line(proc)
    assert "grpo.group_size=2: the checkpoint" in line and "was trained with grpo.group_size=4" in line
    assert "resume_force=[grpo.group_size]" in line
    proc, _ = run_cli([*args, "resume=auto", "trainer.max_steps=2", "trainer.lr=0.25"], tmp_path)
    assert "changed keys applied: trainer.lr, trainer.max_steps" in proc.stdout + proc.stderr
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0][M.LR] == 1e-3 and rows[1][M.LR] == 0.25  # the new lr, not the checkpoint's


def test_resume_force_accepts_a_refused_key_knowingly(tmp_path):
    from grpo_run.safety.resume_policy import ResumeConfigError, check_resume, save_config

    save_config(config([*FAST], tmp_path / "run"), tmp_path)
    changed = config([*FAST, "trainer.seed=7"], tmp_path / "run")
    with pytest.raises(ResumeConfigError, match=r"trainer\.seed=7: .* trained with trainer\.seed=0"):
        check_resume(changed, tmp_path)
    forced = config([*FAST, "trainer.seed=7", "resume_force=[trainer.seed]"], tmp_path / "run")
    assert check_resume(forced, tmp_path) == ["trainer.seed"]


def test_a_zeroed_model_file_of_the_same_size_is_detected_and_an_older_checkpoint_resumed(tmp_path):
    args = [*FAST, *QUIET, "checkpoint.every_steps=1"]
    run_dir = run_here(args, tmp_path / "run")
    weights = run_dir / "checkpoints" / "step_00000002" / "model.safetensors"
    weights.write_bytes(bytes(weights.stat().st_size))
    proc, _ = run_cli([*args, "trainer.max_steps=3", "resume=auto"], tmp_path)
    out = (proc.stdout + proc.stderr).replace("\n", "")  # rich wraps long lines
    assert f"skipping a damaged checkpoint: {weights}: its checksum differs" in out
    assert "step_00000001 (step 1)" in out
    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2, 3]


def test_an_api_key_with_an_unreachable_wandb_host_goes_offline_in_seconds(tmp_path):
    """No outside traffic: the host is a closed port on 127.0.0.1."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed again below: connections are refused
    env = {k: v for k, v in os.environ.items() if k != "WANDB_MODE"}
    env |= {"WANDB_API_KEY": "0" * 40, "WANDB_BASE_URL": f"http://127.0.0.1:{port}"}
    args = [GRPO_RUN, *FAST, "logger=wandb", "trainer.max_steps=1", f"hydra.run.dir={tmp_path / 'run'}"]
    start = time.monotonic()
    proc = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("W&B offline")]
    assert len(lines) == 1 and f"the W&B host http://127.0.0.1:{port} is unreachable" in lines[0], lines
    assert "logger.mode=offline" in lines[0]
    assert list((tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert time.monotonic() - start < 90  # wandb alone retried for 96 s, then raised


def test_logger_mode_online_with_an_unreachable_wandb_host_fails_in_seconds(tmp_path):
    """Online was asked for: no quiet fall-back to offline, but exit 1 naming logger.mode=offline."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k != "WANDB_MODE"}
    env |= {"WANDB_API_KEY": "0" * 40, "WANDB_BASE_URL": f"http://127.0.0.1:{port}"}
    run_dir = tmp_path / "run"
    args = [
        GRPO_RUN,
        *FAST,
        "logger=wandb",
        "logger.mode=online",
        "trainer.max_steps=1",
        f"hydra.run.dir={run_dir}",
    ]
    start = time.monotonic()
    proc = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 1, proc.stderr
    assert last_line(proc) == (
        f"grpo-run: logger.mode=online, but the W&B host http://127.0.0.1:{port} is unreachable (Connection "
        "refused); run with logger.mode=offline (and `wandb sync` later) or fix the network"
    )
    assert not (run_dir / "wandb").exists() and read_metrics(run_dir) == []  # no step ran
    assert time.monotonic() - start < 90


def _tree_digest(folder: Path) -> dict[str, tuple[int, int, bytes]]:
    return {
        str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns, p.read_bytes())
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def test_a_checkpoint_symlinked_from_another_run_is_refused_at_start_naming_it(tmp_path):
    """A folder linked into checkpoints/ (to continue from another run) stops the run before any step,
    naming the link and the resume= that continues from it; that resume reads the other run's files only."""
    other = [*FAST, *QUIET, "checkpoint.every_steps=1"]
    run_here(other, tmp_path / "other" / "run")
    source = tmp_path / "other" / "run" / checkpoint.CHECKPOINTS / checkpoint.step_name(2)
    before = _tree_digest(tmp_path / "other" / "run" / checkpoint.CHECKPOINTS)
    run_dir = tmp_path / "this" / "run"
    (run_dir / checkpoint.CHECKPOINTS).mkdir(parents=True)
    link = run_dir / checkpoint.CHECKPOINTS / checkpoint.step_name(2)
    link.symlink_to(source, target_is_directory=True)
    args = [*FAST, *QUIET, "trainer.max_steps=3", "checkpoint.every_steps=1", f"hydra.run.dir={run_dir}"]
    proc, _ = run_cli([*args, "resume=auto"], tmp_path, check=False)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert str(link) in last_line(proc) and "is a symlink" in last_line(proc)
    assert f"resume={source}" in last_line(proc)
    assert not (run_dir / "metrics.jsonl").exists()  # refused before any step, never mid-run
    link.unlink()
    run_cli([*args, f"resume={source}"], tmp_path)  # what the message suggests: continues from step 2
    assert [row["step"] for row in read_metrics(run_dir)] == [3]
    assert _tree_digest(tmp_path / "other" / "run" / checkpoint.CHECKPOINTS) == before  # only read


def test_a_reward_worker_killed_by_the_os_is_counted_and_said(tmp_path, uninterrupted):
    """At step 2 the reward worker gets SIGKILL once (as from the OOM killer): it is replaced, the step's
    completions are scored again, the step logs train/reward_worker_restarts = 1 and the log says so in
    one line. The other steps do not log the key (a run without a death keeps its metrics.jsonl keys), and
    every other metric equals an uninterrupted run's."""
    counter = tmp_path / "reward-calls"
    env = {
        "PYTHONPATH": os.pathsep.join(p for p in [REWARD_HOOKS, os.environ.get("PYTHONPATH")] if p),
        "GRPO_TEST_REWARD_CALLS": str(counter),
        "GRPO_TEST_KILL_AFTER": "12",  # steps score 8 completions each: the 13th call is in step 2
        "GRPO_TEST_SIGKILL_ONCE": "1",
    }
    proc, run_dir = run_cli(DIES_AT_STEP_3, tmp_path / "killed", env=env)
    assert counter.with_suffix(".killed").exists()
    said = [line for line in (proc.stdout + proc.stderr).splitlines() if "reward workers died" in line]
    assert len(said) == 1 and "train/reward_worker_restarts" in said[0], proc.stdout
    rows = read_metrics(run_dir)
    assert [r.get(M.REWARD_WORKER_RESTARTS) for r in rows] == [None, 1.0, None]
    assert all(M.REWARD_WORKER_RESTARTS not in r for r in read_metrics(uninterrupted))
    restarts_dropped = [{k: v for k, v in r.items() if k != M.REWARD_WORKER_RESTARTS} for r in rows]
    assert without_timings(restarts_dropped) == without_timings(read_metrics(uninterrupted))
