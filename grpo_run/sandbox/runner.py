"""Run one untrusted Python program in a sandboxed child process and say what it came to.

`run_sandboxed(program, tests=..., limits=..., isolation=...)` is the parent's side (the child's is
`_child.py`; the guarantees and limits are written down in docs/sandbox.md):

1. A fresh private folder (`mkdtemp`, mode 0700) holds the program (`work/solution.py`, the child's only
   writable place; the tests are never written there), the mount point of the child's root and the
   child's stdout/stderr file.
2. The child starts as `python -I -S _child.py CONFIG` with an environment of PATH, HOME=/work, TMPDIR=/work
   and LANG only, in a new session (its own process group), stdin a pipe for the nonce and, when the
   judge asks (`ready`), the tests; and one result pipe, written by the judge only.
3. The parent waits at most `limits.wall_s` seconds of wall clock; then it kills the process group (and with
   it the child's pid namespace). Either way it then looks in /proc for any process still running in the
   sandbox (its root or working folder inside the private folder, or the process group) and kills it,
   and removes the folder.
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import select
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from grpo_run.rewards.code import CodeOutcome, TestPlan
from grpo_run.sandbox.limits import Isolation, Limits

CHILD = Path(__file__).with_name("_child.py")
SETUP_FAILED = 125  # the child's exit code when its isolation could not be set up
NOBODY = 65534  # the uid the program runs as when the trainer runs as root
# Read-only in the child's root (when present); the interpreter's own folders are added.
SYSTEM_BINDS = ("/usr", "/bin", "/sbin", "/lib", "/lib64", "/lib32", "/etc/ld.so.cache", "/etc/localtime")
OUTPUT_TAIL = 2000
RESULT_CAP = 1 << 20  # bytes of the result pipe read at most: a program flooding it is killed
KILL_GRACE_S = 2.0  # how long the parent waits for killed processes to vanish


@dataclass(frozen=True)
class SandboxResult:
    outcome: CodeOutcome
    passed: int = 0  # cases passed (per-assert test), else 0
    total: int = 0  # cases recorded (per-assert test), else 0
    detail: str = ""  # the exception type, the limit, the signal, or why the sandbox failed
    isolation: str = ""  # what the child set up, as it reported it
    wall_s: float = 0.0
    strays_killed: int = 0  # processes still running after the program ended, killed by the parent
    output_tail: str = ""  # the end of the program's stdout and stderr (OUTPUT_TAIL bytes at most)


def run_sandboxed(
    source: str,
    *,
    tests: TestPlan | None = None,
    limits: Limits | None = None,
    isolation: Isolation | str = Isolation.AUTO,
    temp_dir: str | None = None,
) -> SandboxResult:
    """Run `source` as a program in the sandbox, and `tests` apart from it against its functions; never
    raises for anything the program does.

    tests: None runs the program alone (it passes when it runs to its end); limits: default `Limits()`;
    temp_dir: where the private folder is made (default: TMPDIR or /tmp).
    """
    limits = limits or Limits()
    start = time.monotonic()
    try:
        folder = Path(tempfile.mkdtemp(prefix="grpo-sandbox-", dir=temp_dir))
    except OSError as exc:
        return SandboxResult(CodeOutcome.SANDBOX_FAILURE, detail=f"no private folder: {exc}")
    try:
        plan = tests or TestPlan("", "", ())
        result = _run_in(folder, source, plan, limits, Isolation(isolation), start)
    except Exception as exc:  # the parent's own failure (fork, pipes, disk): the completion is unscorable
        result = SandboxResult(CodeOutcome.SANDBOX_FAILURE, detail=f"{type(exc).__name__}: {exc}")
    finally:
        _remove(folder)
    if folder.exists():
        return SandboxResult(CodeOutcome.SANDBOX_FAILURE, detail=f"could not remove {folder}")
    return result


def _run_in(
    folder: Path, source: str, tests: TestPlan, limits: Limits, isolation: Isolation, start: float
) -> SandboxResult:
    work, root = _write_program(folder, source)
    nonce = secrets.token_hex(16)
    read_end, write_end = os.pipe()
    config = _child_config(root, work, limits, isolation, write_end)
    process = _start_child(folder, config, _child_env(isolation, work), read_end, write_end)
    try:
        plan = {"prompt": tests.prompt, "test": tests.test, "candidates": list(tests.candidates)}
        lines, timed_out = _talk(process, read_end, nonce, json.dumps(plan) + "\n", start + limits.wall_s)
    finally:
        if process.poll() is None:
            _kill_group(process.pid)
        process.wait()
        os.close(read_end)
    strays = _kill_strays(folder, process.pid)
    wall = time.monotonic() - start
    result = _classify(lines, process.returncode, timed_out)
    return dataclasses.replace(result, wall_s=wall, strays_killed=strays, output_tail=_output_tail(folder))


def _write_program(folder: Path, source: str) -> tuple[Path, Path]:
    """Makes the work folder (with `solution.py`) and the root's mount point; returns (work, root). As
    root, the work folder goes to the uid the program runs as."""
    work, root = folder / "work", folder / "root"
    work.mkdir()
    root.mkdir()
    (work / "solution.py").write_text(source, encoding="utf-8")
    if os.geteuid() == 0:
        for path in (work, work / "solution.py"):
            os.chown(path, NOBODY, NOBODY)
    return work, root


def _child_config(root: Path, work: Path, limits: Limits, isolation: Isolation, result_fd: int) -> dict:
    """The child's one argument (as JSON): its folders, binds, limits, mode and result pipe."""
    return {
        "root": str(root),
        "workdir": str(work),
        "ro_binds": _binds(),
        "limits": {
            "cpu_s": limits.cpu_s,
            "memory_mb": limits.memory_mb,
            "file_mb": limits.file_mb,
            "processes": limits.processes,
            "open_files": limits.open_files,
        },
        "drop_uid": NOBODY,
        "mode": isolation.value,
        "parent": os.getpid(),
        "result_fd": result_fd,
    }


def _child_env(isolation: Isolation, work: Path) -> dict[str, str]:
    """The child's whole environment. /work is the work folder inside the namespaces' root; without
    one (audit) the program's home and temporary folder are the work folder itself."""
    env = {"PATH": "/usr/bin:/bin", "HOME": "/work", "TMPDIR": "/work", "LANG": "C.UTF-8"}
    if isolation is Isolation.AUDIT:
        env |= {"HOME": str(work), "TMPDIR": str(work)}
    return env


def _start_child(
    folder: Path, config: dict, env: dict[str, str], read_end: int, write_end: int
) -> subprocess.Popen:
    """Starts the child in a session of its own, its output to `folder/output`; the parent's copy of the
    result pipe's write end is closed either way (and its read end too when the start fails)."""
    with open(folder / "output", "wb") as output:
        try:
            return subprocess.Popen(
                [_interpreter(), "-I", "-S", str(CHILD), json.dumps(config)],
                stdin=subprocess.PIPE,
                stdout=output,
                stderr=output,
                pass_fds=(write_end,),
                cwd=str(folder),
                env=env,
                start_new_session=True,
            )
        except BaseException:
            os.close(read_end)
            raise
        finally:
            os.close(write_end)


def _output_tail(folder: Path) -> str:
    """The last OUTPUT_TAIL bytes of the child's stdout and stderr."""
    with open(folder / "output", "rb") as output:
        output.seek(max(0, os.fstat(output.fileno()).st_size - OUTPUT_TAIL))
        return output.read().decode(errors="replace")


def _talk(
    process: subprocess.Popen, read_end: int, nonce: str, tests: str, deadline: float
) -> tuple[list[str], bool]:
    """The child's result lines (nonce stripped) until it exits or the deadline passes (then: True).

    The tests go to the child's stdin once its judge says `ready` (it has forked the program by then),
    written without blocking, so a judge that stops reading cannot hold the parent past the deadline."""
    assert process.stdin is not None
    process.stdin.write(f"{nonce}\n".encode())
    process.stdin.flush()
    stdin = process.stdin.fileno()
    buffer, lines, timed_out, reaper, received = b"", [], False, None, 0
    pending, sent = b"", False
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            timed_out = process.poll() is None
            break
        ready, writable, _ = select.select([read_end], [stdin] if pending else [], [], min(left, 0.5))
        if writable:
            pending = _send_some(stdin, pending)
        if not ready:
            if not writable and process.poll() is not None:
                break  # exited, but a stray holds the pipe open: stop reading
            continue
        chunk = os.read(read_end, 65536)
        if not chunk:
            break  # every writer is gone
        received += len(chunk)
        if received > RESULT_CAP:
            lines.append("result error 0 0 flooded_the_result_pipe")
            timed_out = False
            _kill_sandbox(process, reaper)
            break
        found, buffer = _nonce_lines(buffer + chunk, nonce)
        for rest in found:
            if rest.startswith("reaper "):
                reaper = int(rest.split()[1])
            if rest.startswith("map ") and not any(line.startswith("setup ") for line in lines):
                _map_ids(int(rest.split()[1]))
                process.stdin.write(b"mapped\n")
                process.stdin.flush()
            if rest == "ready" and not sent:
                sent, pending = True, tests.encode()
                os.set_blocking(stdin, False)
            lines.append(rest)
    if timed_out:
        _kill_sandbox(process, reaper)
    try:
        process.stdin.close()
    except OSError:
        pass
    return lines, timed_out


def _send_some(stdin: int, pending: bytes) -> bytes:
    """Writes what the child's stdin takes of `pending` without blocking; returns what is left."""
    try:
        return pending[os.write(stdin, pending) :]
    except BlockingIOError:
        return pending
    except OSError:  # the judge is gone: its result (or none) says what happened
        return b""


def _nonce_lines(buffer: bytes, nonce: str) -> tuple[list[str], bytes]:
    """The complete lines of `buffer` that start with the nonce (nonce stripped, any other line dropped),
    and the incomplete end left for the next read."""
    found = []
    while b"\n" in buffer:
        raw, buffer = buffer.split(b"\n", 1)
        head, _, rest = raw.decode(errors="replace").partition(" ")
        if head == nonce:
            found.append(rest)
    return found, buffer


def _map_ids(pid: int) -> None:
    """Root's half of the child's user namespace: 0 and the unprivileged uid/gid map to themselves."""
    for name in ("uid_map", "gid_map"):
        Path(f"/proc/{pid}/{name}").write_text(f"0 0 1\n{NOBODY} {NOBODY} 1\n")


def _classify(lines: list[str], returncode: int, timed_out: bool) -> SandboxResult:
    setup = next((line.split(" ", 1)[1] for line in lines if line.startswith("setup ")), "")
    failure = next((line.split(" ", 1)[1] for line in lines if line.startswith("sandbox_failure ")), None)
    result = next((line.split(" ", 4) for line in lines if line.startswith("result ")), None)
    if failure is not None:
        return SandboxResult(CodeOutcome.SANDBOX_FAILURE, detail=failure, isolation=setup)
    if timed_out:
        return SandboxResult(CodeOutcome.TIMEOUT, detail="wall", isolation=setup)
    if result is not None and len(result) >= 5:
        _, kind, passed, total, detail = result[:5]
        outcome = _KINDS.get(kind, CodeOutcome.ERROR)
        if kind == "limit":
            outcome = _LIMITS.get(detail, CodeOutcome.ERROR)
        return SandboxResult(outcome, int(passed), int(total), "" if detail == "-" else detail, setup)
    if not setup:
        why = f"the child exited with {returncode} before setting up"
        return SandboxResult(CodeOutcome.SANDBOX_FAILURE, detail=why)
    # Killed by a signal: -N from the direct child (audit mode), 128 + N through the namespace's init.
    if returncode < 0 or returncode > 128:
        sig = -returncode if returncode < 0 else returncode - 128
        name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else str(sig)
        if sig in (signal.SIGXCPU, signal.SIGKILL):
            return SandboxResult(CodeOutcome.TIMEOUT, detail=f"cpu ({name})", isolation=setup)
        if sig == signal.SIGXFSZ:
            return SandboxResult(CodeOutcome.LIMIT_FILE_SIZE, detail=name, isolation=setup)
        return SandboxResult(CodeOutcome.ERROR, detail=name, isolation=setup)
    return SandboxResult(
        CodeOutcome.ERROR, detail=f"exited ({returncode}) before its tests finished", isolation=setup
    )


_KINDS = {
    "passed": CodeOutcome.PASSED,
    "failed": CodeOutcome.FAILED,
    "error": CodeOutcome.ERROR,
    "timeout": CodeOutcome.TIMEOUT,
}
_LIMITS = {
    "memory": CodeOutcome.LIMIT_MEMORY,
    "processes": CodeOutcome.LIMIT_PROCESSES,
    "file_size": CodeOutcome.LIMIT_FILE_SIZE,
    "open_files": CodeOutcome.LIMIT_OPEN_FILES,
}


def _interpreter() -> str:
    """The base interpreter (a virtualenv's python is a link to it; the child needs no site-packages)."""
    return os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)


def _binds() -> list[str]:
    """System folders and the interpreter's prefix and folder, without any inside another."""
    paths = [*SYSTEM_BINDS, os.path.realpath(sys.base_prefix), os.path.dirname(_interpreter())]
    keep: list[str] = []
    for path in paths:
        real = os.path.realpath(path)
        inside = any(real == k or real.startswith(k.rstrip("/") + "/") for k in keep if not os.path.islink(k))
        if os.path.islink(path) or not inside:  # a link is copied as a link, never bound
            keep.append(path)
    return keep


def _kill_sandbox(process: subprocess.Popen, reaper: int | None) -> None:
    """Kill the pid namespace through its reaper (then the child reaps it and exits), else the group."""
    if reaper is not None:
        try:
            os.kill(reaper, signal.SIGKILL)
            process.wait(timeout=KILL_GRACE_S)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
    _kill_group(process.pid)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def sandbox_processes(folder: Path, pgid: int) -> list[int]:
    """Pids still running in the sandbox: in its process group, or with a root or cwd inside `folder`
    (zombies, which run nothing and wait for their parent or init to reap them, are left out)."""
    inside = str(folder)
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        try:
            with open(f"/proc/{pid}/stat", "rb") as handle:
                if handle.read().rsplit(b")", 1)[1].split()[0] == b"Z":
                    continue
        except (OSError, IndexError):
            continue
        try:
            if os.getpgid(pid) == pgid:
                found.append(pid)
                continue
        except (ProcessLookupError, PermissionError):
            continue
        for link in ("root", "cwd"):
            try:
                target = os.readlink(f"/proc/{pid}/{link}")
            except OSError:
                continue
            if target == inside or target.startswith(inside + "/"):
                found.append(pid)
                break
    return found


def _kill_strays(folder: Path, pgid: int) -> int:
    """Kill whatever of the sandbox still runs; the number of processes found the first time."""
    first = sandbox_processes(folder, pgid)
    deadline = time.monotonic() + KILL_GRACE_S
    pids = first
    while pids and time.monotonic() < deadline:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.01)
        pids = sandbox_processes(folder, pgid)
    if pids:
        raise RuntimeError(f"sandbox processes {pids} survived SIGKILL for {KILL_GRACE_S} s")
    return len(first)


def _remove(folder: Path) -> None:
    def make_writable(function, path, _exc):  # a program may leave a folder without write permission
        try:
            os.chmod(os.path.dirname(path), stat.S_IRWXU)
            os.chmod(path, stat.S_IRWXU)
        except OSError:
            pass
        function(path)

    shutil.rmtree(folder, onerror=make_writable)
