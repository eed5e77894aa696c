"""The code sandbox (grpo_run/sandbox/) on hostile programs: each is contained and counted by kind, and the
machine is left as it was (no process of the sandbox running, no file left in its temporary folder).

Network safety: no test sends a packet anywhere but loopback. The "outside address" is 192.0.2.1
(TEST-NET-1) through a UDP connect, which sends nothing even where it succeeds; the TCP test connects only
to a server this test listens on at 127.0.0.1.
"""

import gzip
import json
import os
import socket
import time

import pytest

from grpo_run.rewards.code import CodeOutcome, build_program, build_tests
from grpo_run.sandbox.limits import Isolation, Limits
from grpo_run.sandbox.runner import CHILD, run_sandboxed
from grpo_run.scoring import RewardPool, RewardSpec, score
from tests.conftest import SHARED_DATA

HUMANEVAL = SHARED_DATA / "humaneval_test.jsonl.gz"
# Generous for a loaded machine: these tests are about outcomes, the timeout tests set their own budget.
FAST = Limits(wall_s=15.0, cpu_s=10)


def namespaces_available() -> bool:
    return "namespaces" in run_sandboxed("pass\n", isolation="auto").isolation


MODES = [
    pytest.param(
        Isolation.NAMESPACES,
        marks=pytest.mark.skipif(not namespaces_available(), reason="no unprivileged user namespaces"),
    ),
    Isolation.AUDIT,
]


def sandbox_pids() -> list[int]:
    """Processes running this worktree's sandbox child (their command line names _child.py)."""
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/cmdline", "rb") as handle:
                    if str(CHILD).encode() in handle.read():
                        found.append(int(entry.name))
            except OSError:
                continue
    return found


def no_sandbox_left(grace_s: float = 10.0) -> list[int]:
    """The sandbox processes still running once `grace_s` has passed: a killed process takes a moment
    to be reaped on a loaded machine, while a leaked one (a sleeping grandchild) is still there."""
    deadline = time.monotonic() + grace_s
    while (pids := sandbox_pids()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return pids


@pytest.fixture
def run(tmp_path):
    """run(source, isolation, limits) in a temp folder of its own; checks that nothing is left behind."""
    folder = tmp_path / "sandboxes"
    folder.mkdir()

    def go(source, isolation, limits=FAST, tests=None):
        result = run_sandboxed(source, tests=tests, isolation=isolation, limits=limits, temp_dir=str(folder))
        assert list(folder.iterdir()) == []  # the private folder is gone, with everything written in it
        assert no_sandbox_left() == []  # no process of the sandbox still runs
        return result

    return go


@pytest.mark.parametrize("isolation", MODES)
def test_a_passing_program_passes_and_says_its_isolation(run, isolation):
    result = run("assert sum([1, 2]) == 3\n", isolation)
    assert result.outcome is CodeOutcome.PASSED
    expected = "namespaces(user,net,mount,pid)" if isolation is Isolation.NAMESPACES else "audit-hook"
    assert result.isolation.startswith(expected)


@pytest.mark.parametrize("isolation", MODES)
@pytest.mark.parametrize(
    "source,outcome,detail",
    [
        ("assert 1 + 1 == 3\n", CodeOutcome.FAILED, ""),
        ("def f(:\n    pass\n", CodeOutcome.ERROR, "SyntaxError"),
        ("raise KeyError('x')\n", CodeOutcome.ERROR, "KeyError"),
        ("import sys\nsys.exit(0)\n", CodeOutcome.ERROR, "SystemExit"),  # exiting early is no pass
        ("import os\nos._exit(0)\n", CodeOutcome.ERROR, "exited (0) before its tests finished"),
        ("x = bytearray(10 * 2**30)\n", CodeOutcome.LIMIT_MEMORY, "memory"),  # 10 GB
        ("files = [open('/dev/null') for _ in range(1000)]\n", CodeOutcome.LIMIT_OPEN_FILES, "open_files"),
        (  # 1 GB written in 1 MB pieces: refused at file_mb
            "with open('big', 'wb') as f:\n    for _ in range(1024):\n        f.write(b'0' * 2**20)\n",
            CodeOutcome.LIMIT_FILE_SIZE,
            "file_size",
        ),
    ],
)
def test_outcomes_are_told_apart(run, isolation, source, outcome, detail):
    result = run(source, isolation)
    assert (result.outcome, result.detail) == (outcome, detail)


@pytest.mark.parametrize("isolation", MODES)
def test_an_endless_loop_times_out_within_the_budget(run, isolation):
    limits = Limits(wall_s=1.5, cpu_s=1)
    start = time.monotonic()
    result = run("while True:\n    pass\n", isolation, limits)
    elapsed = time.monotonic() - start
    assert result.outcome is CodeOutcome.TIMEOUT
    # The bound proves the loop was stopped at its budget, not left to run: the wall budget plus the kill,
    # the namespaces' teardown, the /proc scans and the folder's removal, which take seconds on a loaded
    # machine.
    assert elapsed < limits.wall_s + 6.0


@pytest.mark.parametrize("isolation", MODES)
def test_a_sleeping_program_is_killed_at_the_wall_budget(run, isolation):
    result = run("import time\ntime.sleep(600)\n", isolation, Limits(wall_s=1.0, cpu_s=5))
    assert (result.outcome, result.detail) == (CodeOutcome.TIMEOUT, "wall")


def test_a_fork_bomb_hits_the_process_limit(run):
    if not namespaces_available():
        pytest.skip("no unprivileged user namespaces")
    # Even as root: the program runs as uid 65534 in its own user namespace, so RLIMIT_NPROC holds.
    result = run("import os\nwhile True:\n    os.fork()\n", Isolation.NAMESPACES)
    assert (result.outcome, result.detail) == (CodeOutcome.LIMIT_PROCESSES, "processes")


def test_the_fallback_refuses_fork_and_subprocesses(run):
    sources = (
        "import os\nos.fork()\n",
        "import subprocess\nsubprocess.run(['true'])\n",
        "import sys\nsys.modules['__main__'].libc.getpid()\n",  # the harness's own ctypes handle
    )
    for source in sources:
        result = run(source, Isolation.AUDIT)
        assert (result.outcome, result.detail) == (CodeOutcome.ERROR, "PermissionError")


def test_a_grandchild_left_running_is_killed_with_the_sandbox(run):
    if not namespaces_available():
        pytest.skip("no unprivileged user namespaces")
    # The child leaves the process group (setsid) and sleeps: it dies with the pid namespace.
    source = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(600)\n"
    result = run(source, Isolation.NAMESPACES)  # `run` asserts no sandbox process remains
    assert result.outcome is CodeOutcome.PASSED


@pytest.fixture
def listener():
    """A TCP server on 127.0.0.1 of the host; yields (port, accepted()): did anyone connect?"""
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(0.2)

    def accepted() -> bool:
        try:
            server.accept()[0].close()
            return True
        except TimeoutError:
            return False

    yield server.getsockname()[1], accepted
    server.close()


def test_the_network_namespace_has_no_way_out(run, listener):
    if not namespaces_available():
        pytest.skip("no unprivileged user namespaces")
    port, accepted = listener
    source = f"""
import errno, socket
assert [name for _, name in socket.if_nameindex()] == ["lo"], socket.if_nameindex()
udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)  # a UDP connect sends no packet
try:
    udp.connect(("192.0.2.1", 9))
    raise SystemError("connected to TEST-NET-1")
except OSError as exc:
    assert exc.errno in (errno.ENETUNREACH, errno.EPERM), exc
tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
tcp.settimeout(1)
try:
    tcp.connect(("127.0.0.1", {port}))
    raise SystemError("reached the host's loopback")
except OSError as exc:
    assert exc.errno in (errno.ENETUNREACH, errno.ECONNREFUSED, errno.EPERM), exc
"""
    result = run(source, Isolation.NAMESPACES)
    assert result.outcome is CodeOutcome.PASSED, result.output_tail
    assert not accepted()


def test_the_fallback_refuses_sockets(run, listener):
    port, accepted = listener
    source = f"""
import socket
for family, kind, address in ((socket.AF_INET, socket.SOCK_DGRAM, ("192.0.2.1", 9)),
                              (socket.AF_INET, socket.SOCK_STREAM, ("127.0.0.1", {port}))):
    try:
        socket.socket(family, kind).connect(address)
        raise SystemError("a socket was made")
    except PermissionError:
        pass
"""
    result = run(source, Isolation.AUDIT)
    assert result.outcome is CodeOutcome.PASSED, result.output_tail
    assert not accepted()


@pytest.mark.parametrize("isolation", MODES)
def test_no_secret_reaches_the_program(run, isolation, monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", "secret-key-that-must-not-leak")
    source = f"""
import os
assert "WANDB_API_KEY" not in os.environ, "the key is in the environment"
assert sorted(os.environ) == ["HOME", "LANG", "PATH", "TMPDIR"], sorted(os.environ)
try:  # the parent's environment through /proc
    leaked = b"secret-key" in open("/proc/{os.getpid()}/environ", "rb").read()
except OSError:
    leaked = False
assert not leaked, "read the parent's environment"
"""
    result = run(source, isolation)
    assert result.outcome is CodeOutcome.PASSED, result.output_tail


@pytest.mark.parametrize("isolation", MODES)
def test_writing_outside_its_folder_is_refused(run, isolation, tmp_path):
    target = tmp_path / "escaped.txt"
    home = os.path.expanduser("~")
    source = f"""
import os
for path in ({str(target)!r}, "/tmp/grpo-sandbox-escape.txt", {home + "/grpo-sandbox-escape.txt"!r}):
    try:
        with open(path, "w") as handle:
            handle.write("out")
        raise SystemError("wrote " + path)
    except OSError:
        pass
with open("inside.txt", "w") as handle:  # its own folder is writable
    handle.write("in")
"""
    result = run(source, isolation)
    assert result.outcome is CodeOutcome.PASSED, result.output_tail
    assert not target.exists()
    assert not os.path.exists("/tmp/grpo-sandbox-escape.txt")
    assert not os.path.exists(home + "/grpo-sandbox-escape.txt")


def test_the_namespace_sees_neither_home_nor_the_run(run):
    if not namespaces_available():
        pytest.skip("no unprivileged user namespaces")
    source = f"""
import os
assert not os.path.exists({os.getcwd()!r} + "/grpo_run"), "the checkout is visible"
entries = os.listdir({os.path.expanduser("~")!r}) if os.path.isdir({os.path.expanduser("~")!r}) else []
assert not [e for e in entries if e not in (".pyenv",)], entries  # at most the interpreter's own folder
"""
    result = run(source, Isolation.NAMESPACES)
    assert result.outcome is CodeOutcome.PASSED, result.output_tail


def test_an_unusable_temp_folder_is_a_sandbox_failure(tmp_path):
    result = run_sandboxed("pass\n", temp_dir=str(tmp_path / "missing"))
    assert result.outcome is CodeOutcome.SANDBOX_FAILURE
    # ... and through the reward: unscorable (None), counted, never a silent 0
    spec = RewardSpec("code_exec", 1.0, {"temp_dir": str(tmp_path / "missing")})
    with RewardPool(preload=()) as pool:
        scores = score(
            [spec], ["def f():\n"], ["    return 1\n"], ["assert f() == 1"], timeout_s=30, pool=pool
        )
    assert scores.total == [None] and scores.unscorable == 1
    assert scores.labels["code_exec/sandbox_failure"] == 1


@pytest.mark.skipif(not HUMANEVAL.exists(), reason="needs ../shared/data/humaneval_test.jsonl.gz")
@pytest.mark.parametrize("isolation", MODES)
def test_every_canonical_solution_passes_and_wrong_ones_do_not(isolation):
    # Through the judge: the tests run apart from the program and see only plain values come back.
    records = [json.loads(line) for line in gzip.open(HUMANEVAL, "rt")]
    assert len(records) == 164
    prompts = [r["prompt"] for r in records]
    tests = [f"{r['test']}\n\ncheck({r['entry_point']})" for r in records]
    with RewardPool(max_workers=2, preload=("grpo_run.sandbox.reward",)) as pool:
        spec = RewardSpec("code_exec", 1.0, {"isolation": isolation.value})
        right = score(
            [spec], prompts, [r["canonical_solution"] for r in records], tests, timeout_s=10, pool=pool
        )
        wrong = score([spec], prompts[:4], ["    return None\n"] * 4, tests[:4], timeout_s=10, pool=pool)
    failing = [records[i]["task_id"] for i, v in enumerate(right.total) if v != 1.0]
    assert failing == []
    assert right.labels["code_exec/passed"] == 164
    assert wrong.total == [0.0] * 4
    assert wrong.labels["code_exec/passed"] == 0
    assert wrong.labels["code_exec/failed"] + wrong.labels["code_exec/error"] == 4


@pytest.mark.skipif(not HUMANEVAL.exists(), reason="needs ../shared/data/humaneval_test.jsonl.gz")
def test_fraction_of_asserts_on_a_real_problem(run):
    record = next(json.loads(line) for line in gzip.open(HUMANEVAL, "rt") if '"HumanEval/0"' in line)
    test = f"{record['test']}\n\ncheck({record['entry_point']})"
    # has_close_elements answering False always: right on the asserts that expect False only
    program = build_program(record["prompt"], "    return False\n")
    result = run(program, Isolation.AUTO, tests=build_tests(record["prompt"], test, per_assert=True))
    assert result.outcome is CodeOutcome.FAILED
    expected = record["test"].count("== False")
    assert (result.passed, result.total) == (expected, record["test"].count("assert"))


@pytest.mark.parametrize("isolation", MODES)
def test_flooding_its_pipe_is_an_error_not_a_judge_out_of_memory(run, isolation):
    # The program writes 4 MB without a newline to every descriptor it holds (its reply pipe among them).
    source = (
        "import os\n"
        "for fd in range(3, 64):\n"
        "    for _ in range(64):\n"
        "        try:\n"
        "            os.write(fd, b'x' * 65536)\n"
        "        except OSError:\n"
        "            break\n"
    )
    result = run(source, isolation, Limits(wall_s=10.0, cpu_s=5))
    assert (result.outcome, result.detail) == (CodeOutcome.ERROR, "flooded_its_pipe")


def test_the_program_holds_no_capability_and_cannot_become_root(run):
    if not namespaces_available():
        pytest.skip("no unprivileged user namespaces")
    # Without capabilities it cannot undo the read-only mounts (or mount anything) in its namespace.
    source = """
import ctypes, os
status = dict(line.split(":", 1) for line in open("/proc/self/status"))
assert int(status["CapEff"], 16) == 0 and int(status["CapPrm"], 16) == 0, status["CapEff"]
libc = ctypes.CDLL(None, use_errno=True)
assert libc.mount(None, b"/", None, 32 | 4096, None) == -1  # MS_REMOUNT | MS_BIND of the read-only root
if os.getuid() != 0:  # the trainer runs as root: the program runs as 65534 and stays there
    for become_root in (lambda: os.setuid(0), lambda: os.setreuid(0, -1)):
        try:
            become_root()
            raise SystemError("became root")
        except PermissionError:
            pass
"""
    result = run(source, Isolation.NAMESPACES)
    assert result.outcome is CodeOutcome.PASSED, result.output_tail


def test_in_the_audit_fallback_the_program_holds_no_capability_either(run):
    # Even as root: what the hook misses, the kernel then refuses (the non-dumpable judge's ptrace and
    # /proc/<pid>/mem need CAP_SYS_PTRACE).
    source = """
status = dict(line.split(":", 1) for line in open("/proc/self/status"))
assert int(status["CapEff"], 16) == 0 and int(status["CapPrm"], 16) == 0, status["CapEff"]
"""
    result = run(source, Isolation.AUDIT)
    assert result.outcome is CodeOutcome.PASSED, (result, result.output_tail)


def child_module():
    """The child script as a module (it is stdlib only and does nothing at import)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("sandbox_child", CHILD)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_only_plain_values_cross_from_the_program():
    child = child_module()
    plain = [None, True, 3, -0.5, "é\n", b"\x00", [1, (2, 3)], {"a": {1, 2}}, frozenset({(1,)}), {(1, 2): []}]
    for value in plain:
        assert child.loads(child.dumps(value)) == value
        assert type(child.loads(child.dumps(value))) is type(value)
    assert child.loads(child.dumps((1.0, 1))) == (1.0, 1)  # float and int stay apart
    # What a program might send instead: each is refused, never turned into an object.
    crafted = [
        b'{"x": 1}',  # an untagged object
        b'{"t": [1], "s": [2]}',  # two tags
        b'{"q": [1]}',  # an unknown tag
        b'{"s": [[1]]}',  # an unhashable set element
        b'{"d": [[1]]}',  # a broken pair
        b'{"b": 7}',  # bytes that are no hex text
        b"[" * 100_000,  # deeper than the decoder goes
        b"1" * 5000,  # an int past Python's digit limit
        b"not json",
    ]
    for line in crafted:
        with pytest.raises(child.NotPlain):
            child.loads(line)

    class Anything:
        def __eq__(self, other):
            return True

    class Text(str):
        def __eq__(self, other):
            return True

    for value in (Anything(), Text("a"), [Anything()], {1: Text("b")}):
        with pytest.raises(child.NotPlain):
            child.dumps(value)


@pytest.mark.parametrize("isolation", MODES)
def test_a_program_that_kills_the_judge_does_not_pass(run, isolation):
    # The judge is the program's parent: killing it leaves no result line, so no pass.
    source = "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nimport time\ntime.sleep(5)\n"
    result = run(source, isolation)
    assert result.outcome not in (CodeOutcome.PASSED, CodeOutcome.SANDBOX_FAILURE), result
