"""The sandbox's child side, run as a script: `python -I -S _child.py CONFIG_JSON` (stdlib only).

It never imports grpo_run: it runs with `-I -S` (no site-packages, no user site, no PYTHON* variables), so
the untrusted program sees the standard library and nothing of the run's environment.

Two processes inside the sandbox, apart (see docs/sandbox.md):
- the judge: it holds the result pipe and, once it asks for them, the tests. It forks the program first,
  so the program never holds a copy of the tests, and it is not dumpable, so the program cannot ptrace it
  or open its /proc files (its descriptors, its memory).
- the program: `solution.py` (prompt + completion) and nothing else. It holds two pipes to the judge only:
  the judge sends calls (`[name, args, kwargs]`), the program answers each with a plain value (JSON with
  tagged tuples, sets, bytes and dicts; `encode`/`loads`). The judge's tests call a `Candidate` proxy that
  forwards each call; an answer that is not a plain value is a failed case.

Protocol with `grpo_run.sandbox.runner` (the parent):
- stdin: one line, a random nonce; every line written to the result pipe starts with it. After `ready`,
  one more line: the tests as JSON (`{"prompt", "test", "candidates"}`), read by the judge only.
- the result pipe (its descriptor number in the config): `<nonce> setup <description>` once isolation is in
  place, `<nonce> ready` when the judge has forked the program, then `<nonce> result <kind> <passed> <total>
  <detail>` from the judge, or `<nonce> sandbox_failure <detail>` when the isolation could not be set up.

Isolation:
- mode "namespaces": new user, network, mount and pid namespaces. A fork becomes pid 1 of the pid namespace
  (the reaper); it builds a new root on a tmpfs (read-only binds of the system and interpreter folders, the
  writable work dir, a new /proc), pivots into it, and forks the judge, which (as root: first dropping to
  an unprivileged uid, so that RLIMIT_NPROC is enforced) forks the program. When the judge ends the reaper
  exits, and the kernel kills everything left in the pid namespace.
- mode "audit" (no namespaces): an audit hook in the program refuses sockets, subprocesses, exec and fork;
  rlimits apply.
"""

import ctypes
import errno
import json
import os
import resource
import signal
import sys

CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000

MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_NOATIME = 1024
MS_NODIRATIME = 2048
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18
MS_RELATIME = 1 << 21
MNT_DETACH = 2

PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
PR_SET_NO_NEW_PRIVS = 38
CAP_VERSION_3 = 0x20080522

# pivot_root has no glibc wrapper; without a known number the root is changed with chroot instead.
PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "ppc64le": 203, "s390x": 217}

# statvfs flags -> mount flags: a bind remount must repeat the source's locked flags (kernel rule).
ST_TO_MS = {
    os.ST_NOSUID: MS_NOSUID,
    os.ST_NODEV: MS_NODEV,
    os.ST_NOEXEC: MS_NOEXEC,
    os.ST_NOATIME: MS_NOATIME,
    os.ST_NODIRATIME: MS_NODIRATIME,
    os.ST_RELATIME: MS_RELATIME,
}

RESULT_FD = -1  # set from the config: the write end of the result pipe
SETUP_FAILED = 125

# The interpreter links the C library: its symbols are already loaded (find_library would run ldconfig).
libc = ctypes.CDLL(None, use_errno=True)


class SetupError(RuntimeError):
    pass


def check(ret, what):
    if ret != 0:
        err = ctypes.get_errno()
        raise SetupError(f"{what}: {errno.errorcode.get(err, err)} ({os.strerror(err)})")


def mount(source, target, fstype, flags, data=None):
    enc = [None if x is None else os.fsencode(x) for x in (source, target, fstype, data)]
    check(libc.mount(enc[0], enc[1], enc[2], ctypes.c_ulong(flags), enc[3]), f"mount {target}")


def locked_flags(path):
    flags = os.statvfs(path).f_flag
    return sum(ms for st, ms in ST_TO_MS.items() if flags & st)


def bind(source, target, *, writable=False):
    """Bind `source` at `target` (created), read-only unless `writable`; symlinks are copied as symlinks."""
    if os.path.islink(source):
        os.makedirs(os.path.dirname(target), exist_ok=True)
        os.symlink(os.readlink(source), target)
        return
    if os.path.isdir(source):
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        open(target, "a").close()
    mount(source, target, None, MS_BIND | MS_REC)
    flags = MS_REMOUNT | MS_BIND | MS_NOSUID | locked_flags(source)
    mount(None, target, None, flags | (0 if writable else MS_RDONLY))


def write_result(nonce, *fields):
    os.write(RESULT_FD, (" ".join([nonce, *map(str, fields)]) + "\n").encode())


def drop_capabilities():
    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [
            ("effective", ctypes.c_uint32),
            ("permitted", ctypes.c_uint32),
            ("inheritable", ctypes.c_uint32),
        ]

    check(libc.capset(ctypes.byref(Header(CAP_VERSION_3, 0)), (Data * 2)()), "capset")
    check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")


def set_limits(limits):
    cpu = int(limits["cpu_s"])
    mb = 1024 * 1024
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_AS, (limits["memory_mb"] * mb,) * 2)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits["file_mb"] * mb,) * 2)
    resource.setrlimit(resource.RLIMIT_NOFILE, (limits["open_files"],) * 2)
    resource.setrlimit(resource.RLIMIT_NPROC, (limits["processes"],) * 2)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    # A write past RLIMIT_FSIZE then fails with EFBIG (counted as a limit) instead of killing silently.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)


def close_other_fds():
    os.closerange(3, RESULT_FD)
    os.closerange(RESULT_FD + 1, 1 << 16)


DEVICES = ("/dev/null", "/dev/zero", "/dev/urandom", "/dev/random")


def build_root(cfg, proc_mount):
    """The new root: a tmpfs with read-only binds, the writable work dir at /work, /proc, a few devices."""
    root = cfg["root"]
    mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
    for path in cfg["ro_binds"]:
        if os.path.lexists(path):
            bind(path, root + path)
    for dev in DEVICES:
        if os.path.exists(dev):
            bind(dev, root + dev, writable=True)  # writes to /dev/null must work
    bind(cfg["workdir"], root + "/work", writable=True)
    os.makedirs(root + "/proc", exist_ok=True)
    proc = "none"
    if proc_mount:
        try:
            mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
            proc = "own"
        except SetupError:
            proc = "hidden"  # e.g. a container's masked /proc: the program sees an empty /proc
    os.makedirs(root + "/oldroot", exist_ok=True)
    number = PIVOT_ROOT.get(os.uname().machine)
    if number is not None:
        check(libc.syscall(number, os.fsencode(root), os.fsencode(root + "/oldroot")), "pivot_root")
        os.chdir("/")
        check(libc.umount2(b"/oldroot", MNT_DETACH), "umount old root")
        os.rmdir("/oldroot")
        how = "pivot_root"
    else:
        os.chdir(root)
        os.chroot(root)
        how = "chroot"
    mount(None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
    os.chdir("/work")
    return f"root={how} proc={proc}"


def write_file(path, text):
    with open(path, "w") as handle:
        handle.write(text)


def drop_root(uid):
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)


def reap(pid):
    """Wait for `pid`, reaping every other child meanwhile; its exit code (128 + signal if killed)."""
    while True:
        try:
            done, status = os.waitpid(-1, 0)
        except ChildProcessError:
            return 1
        if done == pid:
            return os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)


AUDIT_REFUSED = (
    "socket.__new__",
    "socket.socketpair",
    "subprocess.Popen",
    "os.system",
    "os.exec",
    "os.posix_spawn",
    "os.spawn",
    "os.fork",
    "os.forkpty",
    "pty.spawn",
    "ctypes.dlopen",
    "ctypes.dlsym",
    "ctypes.cdata",
    "ctypes.call_function",  # this script's own `libc` is reachable through sys.modules["__main__"]
)


# Events whose first argument is a path the program changes: refused outside the work folder.
AUDIT_WRITES = (
    "os.remove",
    "os.rename",
    "os.rmdir",
    "os.mkdir",
    "os.chmod",
    "os.chown",
    "os.symlink",
    "os.link",
    "os.truncate",
    "os.utime",
    "shutil.rmtree",
    "shutil.move",
    "shutil.copyfile",
)
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
WORKDIR = ""


def outside(path):
    if isinstance(path, int):
        return False  # an open descriptor
    real = os.path.realpath(os.fsdecode(path))
    return real != WORKDIR and not real.startswith(WORKDIR + "/")


def other_process(path):
    """Whether `path` names another process's /proc entry: as written ("/proc/self/../<pid>/mem", relative
    from /proc) or once its links are followed ("/proc/self/root/proc/<pid>/mem", "/proc/self/cwd/...")."""
    own = (f"/proc/{os.getpid()}", "/proc/self", "/proc/thread-self")
    for name in (os.path.abspath(os.fsdecode(path)), os.path.realpath(os.fsdecode(path))):
        if name.startswith("/proc/") and not any(name == p or name.startswith(p + "/") for p in own):
            return True
    return False


def refuse(event, args):
    """The audit hook of the fallback: Python-level only (see docs/sandbox.md for what it does not stop)."""
    if event in AUDIT_REFUSED or (event == "import" and args and args[0] in ("_posixsubprocess", "_ctypes")):
        raise PermissionError(f"the sandbox refuses {event}")
    if event == "open" and args:
        path, flags = args[0], args[2] if len(args) > 2 and isinstance(args[2], int) else 0
        mode = args[1] if len(args) > 1 and isinstance(args[1], str) else ""
        writes = flags & WRITE_FLAGS or any(c in mode for c in "wax+")
        if writes and outside(path):
            raise PermissionError(f"the sandbox refuses writing {path!r}")
        if not isinstance(path, int):
            if other_process(path):
                raise PermissionError(f"the sandbox refuses reading {path!r} (other processes)")
            # The event does not carry dir_fd: a folder's descriptor outside the work folder ("/", "/proc")
            # would let a relative name reach any path, /proc/<judge's pid>/mem among them.
            if os.path.isdir(path) and outside(path):
                raise PermissionError(f"the sandbox refuses opening the folder {path!r}")
    if event in AUDIT_WRITES and args and outside(args[0]):
        raise PermissionError(f"the sandbox refuses {event} on {args[0]!r}")


# --- plain values: the only thing that crosses from the program to the judge ------------------------------
# JSON, with one-key objects tagging what JSON lacks: {"t": [...]} tuple, {"s": [...]} set, {"f": [...]}
# frozenset, {"b": "hex"} bytes, {"d": [[key, value], ...]} dict. Decoding builds nothing else: a reply that
# is not such a value (an object of the program's own class, a subclass, anything crafted) is refused.
REPLY_CAP = 1 << 20  # bytes of one reply: a program flooding its pipe is stopped there
LIMITS = ("memory", "processes", "file_size", "open_files")


class NotPlain(ValueError):
    pass


def encode(value):
    kind = type(value)  # exact types: a subclass could redefine __eq__
    if value is None or kind in (bool, int, float, str):
        return value
    if kind is list:
        return [encode(v) for v in value]
    if kind is tuple:
        return {"t": [encode(v) for v in value]}
    if kind is set:
        return {"s": [encode(v) for v in value]}
    if kind is frozenset:
        return {"f": [encode(v) for v in value]}
    if kind is bytes:
        return {"b": value.hex()}
    if kind is dict:
        return {"d": [[encode(k), encode(v)] for k, v in value.items()]}
    raise NotPlain(kind.__name__)


def dumps(value):
    return (json.dumps(encode(value), separators=(",", ":")) + "\n").encode()


def _tagged(pairs):
    if len(pairs) != 1:
        raise NotPlain("an untagged object")
    tag, body = pairs[0]
    if tag == "b" and type(body) is str:
        return bytes.fromhex(body)
    if type(body) is not list:
        raise NotPlain(f"tag {tag!r}")
    if tag == "t":
        return tuple(body)
    if tag == "s":
        return set(body)
    if tag == "f":
        return frozenset(body)
    if tag == "d" and all(type(p) is list and len(p) == 2 for p in body):
        return dict(body)
    raise NotPlain(f"tag {tag!r}")


def loads(line):
    """The plain value of one line, or NotPlain; never anything else (bad JSON, unhashable keys, depth)."""
    try:
        return json.loads(line, object_pairs_hook=_tagged)
    except NotPlain:
        raise
    except (ValueError, TypeError, RecursionError, MemoryError) as exc:
        raise NotPlain(type(exc).__name__) from None


def classify(exc):
    """(kind, detail) of an exception that ended a program's code."""
    if isinstance(exc, AssertionError):
        return "failed", ""
    if isinstance(exc, MemoryError):
        return "limit", "memory"
    if isinstance(exc, OSError):
        if exc.errno == errno.EAGAIN and isinstance(exc, BlockingIOError):
            return "limit", "processes"
        if exc.errno == errno.EFBIG:
            return "limit", "file_size"
        if exc.errno == errno.EMFILE:
            return "limit", "open_files"
    return "error", type(exc).__name__


# --- the program's process: the untrusted code, and nothing to report with but its replies ----------------


def run_program(cfg, audit, calls_fd, replies_fd):
    """Runs `solution.py` (prompt + completion, no tests), then answers the judge's calls until its pipe
    closes. It holds only its two pipes (no result pipe, no stdin where the tests travel)."""
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    low, high = sorted((calls_fd, replies_fd))
    os.closerange(3, low)
    os.closerange(low + 1, high)
    os.closerange(high + 1, 1 << 16)
    check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "pdeathsig")
    calls = os.fdopen(calls_fd, "rb")
    replies = os.fdopen(replies_fd, "wb")
    source = open("solution.py", encoding="utf-8").read()
    main = os.getpid()
    if audit:
        # The namespaces' judge dropped them before the fork; here the program gives up its own (root's,
        # or those of the user namespace whose root could not be built), so that the kernel, not only the
        # hook, keeps it out of the non-dumpable judge (ptrace, /proc/<pid>/mem need CAP_SYS_PTRACE then).
        drop_capabilities()
        global WORKDIR
        WORKDIR = os.path.realpath(os.getcwd())
        sys.addaudithook(refuse)
    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    try:
        exec(compile(source, "solution.py", "exec"), namespace)  # noqa: S102 - the point of the sandbox
        reply = dumps(["loaded"])
    except BaseException as exc:  # SystemExit too: a program that exits early did not pass its tests
        reply = dumps(["load_failed", *classify(exc)])
    loaded = reply.startswith(b'["loaded"')
    while True:
        if os.getpid() != main:  # a forked child of the program got here: only the program answers
            os._exit(0)
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except BaseException:
            pass
        replies.write(reply)
        replies.flush()
        if not loaded:
            os._exit(0)
        line = calls.readline()
        if not line:
            os._exit(0)
        name, args, kwargs = loads(line)  # the judge's: plain by construction
        function = namespace.get(name)
        try:
            if function is None:
                raise NameError(name)
            value = function(*args, **kwargs)
            try:
                reply = dumps(["value", value])
            except (NotPlain, RecursionError):
                reply = dumps(["not_plain", type(value).__name__])
        except BaseException as exc:
            kind, detail = classify(exc)
            reply = dumps(["limit", detail] if kind == "limit" else ["raised", detail or "AssertionError"])


# --- the judge's process: the tests, against proxies of the program's functions ---------------------------


class CandidateFailed(AssertionError):
    """The candidate's answer was no plain value, or it raised AssertionError: a failed case."""


class CandidateRaised(Exception):
    """The candidate raised (its exception's type name is the detail): an error case."""


class CandidateLimit(Exception):
    """The candidate hit a limit (memory, processes, file size, open files)."""


class ProgramGone(BaseException):
    """The program's process closed its pipe (exited, killed): nothing more can be asked of it."""


class Flooded(BaseException):
    """A reply longer than REPLY_CAP."""


class Channel:
    def __init__(self, calls_fd, replies_fd):
        self.calls = os.fdopen(calls_fd, "wb")
        self.replies = os.fdopen(replies_fd, "rb")

    def receive(self):
        line = self.replies.readline(REPLY_CAP + 1)
        if not line:
            raise ProgramGone
        if len(line) > REPLY_CAP or not line.endswith(b"\n"):
            raise Flooded
        try:
            reply = loads(line)
        except NotPlain:
            return ["garbled"]
        return reply if type(reply) is list and reply and type(reply[0]) is str else ["garbled"]

    def call(self, name, args, kwargs):
        try:
            line = dumps([name, list(args), kwargs])
        except NotPlain as exc:
            raise CandidateRaised(f"argument not plain: {exc}") from None
        try:
            self.calls.write(line)
            self.calls.flush()
        except BrokenPipeError:
            raise ProgramGone from None
        reply = self.receive()
        if reply[0] == "value" and len(reply) == 2:
            return reply[1]
        detail = reply[1] if len(reply) == 2 and type(reply[1]) is str else ""
        if reply[0] == "limit" and detail in LIMITS:
            raise CandidateLimit(detail)
        if reply[0] == "raised" and detail != "AssertionError":
            raise CandidateRaised(one_word(detail))
        raise CandidateFailed(reply[0])  # AssertionError, not plain, garbled


class Candidate:
    """What the tests call: each call goes to the program's process, the answer comes back as plain data."""

    def __init__(self, channel, name):
        self._channel, self._name = channel, name

    def __call__(self, *args, **kwargs):
        return self._channel.call(self._name, args, kwargs)


def one_word(text):
    return "".join(c if c.isalnum() or c in "_." else "_" for c in text[:80]) or "-"


def program_end(pid):
    """(kind, detail) of the program's process, which closed its pipe: its exit status."""
    status = reap(pid)
    if status > 128:
        sig = status - 128
        name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else str(sig)
        if sig in (signal.SIGXCPU, signal.SIGKILL):
            return "timeout", f"cpu ({name})"
        if sig == signal.SIGXFSZ:
            return "limit", "file_size"
        return "error", name
    return "error", f"exited ({status}) before its tests finished"


def run_tests(channel, plan):
    """Runs the prompt (the problem's own helpers), binds the candidates, runs the test: (kind, detail, ns)."""
    first = channel.receive()
    if first[0] == "load_failed" and len(first) == 3:
        kind, detail = first[1], first[2]
        if kind == "failed" or (kind == "limit" and detail in LIMITS):
            return kind, detail, {}
        return "error", one_word(str(detail)), {}
    if first[0] != "loaded":
        return "error", "garbled_reply", {}
    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    try:
        prompt = compile(plan["prompt"], "prompt.py", "exec")
    except SyntaxError:  # a prompt that ends mid-function: its stub needs a body of its own here
        prompt = compile(plan["prompt"] + "\n    pass\n", "prompt.py", "exec")
    exec(prompt, namespace)  # noqa: S102 - the problem's own code, trusted like its tests
    for name in plan["candidates"]:
        namespace[name] = Candidate(channel, name)
    exec(compile(plan["test"], "test.py", "exec"), namespace)  # noqa: S102
    return "passed", "", namespace


def give_up_rights(cfg, audit):
    """The judge's limits and rights, set before the fork so that the program inherits them."""
    set_limits(cfg["limits"])
    if not audit:
        drop_capabilities()
    elif os.geteuid() == 0:
        # The parent gave the work folder to the uid a namespaces' program runs as; this program stays
        # root but gives up its capabilities, so it must own its folder to write in it.
        for path in (".", "solution.py"):
            try:
                os.chown(path, 0, 0)
            except OSError:
                pass  # then its writes fail: an error of the program, never a pass
    # Before the fork: the program (same uid) can neither ptrace this process nor open its /proc files.
    check(libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0), "dumpable")


def fork_program(cfg, audit):
    """Forks the program with its two pipes to the judge; returns its pid and the judge's pipe ends
    (calls_w, replies_r). The child never returns."""
    calls_r, calls_w = os.pipe()
    replies_r, replies_w = os.pipe()
    program = os.fork()
    if program == 0:
        os.close(calls_w)
        os.close(replies_r)
        try:
            run_program(cfg, audit, calls_r, replies_w)
        finally:
            os._exit(1)
    os.close(calls_r)
    os.close(replies_w)
    return program, calls_w, replies_r


def outcome_of_tests(channel, plan, program):
    """Runs the tests against the program, then kills it if it is still there: (kind, detail, ns)."""
    namespace = {}
    try:
        kind, detail, namespace = run_tests(channel, plan)
    except ProgramGone:
        kind, detail = program_end(program)
        program = None
    except Flooded:
        kind, detail = "error", "flooded_its_pipe"
    except CandidateLimit as exc:
        kind, detail = "limit", str(exc)
    except CandidateRaised as exc:
        kind, detail = "error", str(exc)
    except BaseException as exc:
        kind, detail = classify(exc)
    if program is not None:
        os.kill(program, signal.SIGKILL)
        reap(program)
    return kind, detail, namespace


def count_cases(kind, namespace):
    """(kind, passed, total) from the cases the per-assert test recorded (grpo_run.rewards.code): a
    passing run with a failed or erroring case is not a pass."""
    passed, total = 0, 0
    cases = namespace.get("__grpo_cases__")
    if (
        kind == "passed"
        and isinstance(cases, list)
        and all(x in ("passed", "failed", "error") for x in cases)
    ):
        passed, total = cases.count("passed"), len(cases)
        if passed < total:
            kind = "error" if "error" in cases else "failed"
    return kind, passed, total


def judge(nonce, cfg, audit):
    """Forks the program's process, then receives the tests (after the fork: the program never holds a
    copy) and runs them; writes the one result line and exits. The program inherits the limits and the
    dropped rights."""
    give_up_rights(cfg, audit)
    program, calls_w, replies_r = fork_program(cfg, audit)
    write_result(nonce, "ready")
    plan = json.loads(sys.stdin.readline())
    channel = Channel(calls_w, replies_r)
    kind, detail, namespace = outcome_of_tests(channel, plan, program)
    kind, passed, total = count_cases(kind, namespace)
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:
        pass
    write_result(nonce, "result", kind, passed, total, (detail or "-").replace("\n", " "))
    os._exit(0)


def enter_namespaces(nonce, cfg, mode, drop):
    """Checks the parent, then unshares the user, network, mount and pid namespaces and maps the ids;
    returns (namespaces, why): whether they exist, and why not. Exits SETUP_FAILED when setup fails."""
    try:
        check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "pdeathsig")
        if os.getppid() != cfg["parent"]:
            os._exit(SETUP_FAILED)
        namespaces = mode != "audit"
        why = ""
        if namespaces:
            flags = CLONE_NEWUSER | CLONE_NEWNET | CLONE_NEWNS | CLONE_NEWPID
            uid, gid = os.geteuid(), os.getegid()
            if libc.unshare(flags) != 0:
                err = ctypes.get_errno()
                why = errno.errorcode.get(err, str(err))
                if mode == "namespaces":
                    raise SetupError(f"unshare(user, net, mount, pid): {why} ({os.strerror(err)})")
                namespaces = False
            elif drop is not None:
                # Root: the parent (root outside) maps 0 and the unprivileged uid, so that the program can
                # give up root for good (then RLIMIT_NPROC holds: the kernel exempts only a real uid 0).
                write_result(nonce, "map", os.getpid())
                if sys.stdin.readline().strip() != "mapped":
                    raise SetupError("the parent did not map the user namespace's ids")
            else:
                # The same ids inside as outside: files the program makes are owned by that uid.
                write_file("/proc/self/setgroups", "deny")
                write_file("/proc/self/uid_map", f"{uid} {uid} 1")
                write_file("/proc/self/gid_map", f"{gid} {gid} 1")
    except (SetupError, OSError) as exc:
        write_result(nonce, "sandbox_failure", str(exc).replace("\n", " "))
        os._exit(SETUP_FAILED)
    return namespaces, why


def build_pid1_root(nonce, cfg, mode):
    """As pid 1 of the new pid namespace, builds the new root and returns its description; when it cannot
    be built and the mode is "auto", judges with the audit hook instead (never returns then)."""
    try:
        check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "pdeathsig")
        mount(None, "/", None, MS_REC | MS_PRIVATE)
        described = build_root(cfg, proc_mount=True)
        check(libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0), "dumpable")  # the program cannot ptrace the reaper
    except (SetupError, OSError) as exc:
        why = str(exc).replace("\n", " ")
        if mode != "auto":
            write_result(nonce, "sandbox_failure", why)
            os._exit(SETUP_FAILED)
        # The namespaces exist but their root could not be built (a security module refusing mounts, as
        # Ubuntu's AppArmor does for unprivileged user namespaces): the fallback, in the new network
        # namespace still.
        try:
            os.chdir(cfg["workdir"])
        except OSError as chdir_exc:
            write_result(nonce, "sandbox_failure", f"{why}; then {chdir_exc}".replace("\n", " "))
            os._exit(SETUP_FAILED)
        write_result(nonce, "setup", f"audit-hook+net-namespace (root not built: {why}) uid={os.getuid()}")
        judge(nonce, cfg, audit=True)
    return described


def main():
    global RESULT_FD
    cfg = json.loads(sys.argv[1])
    RESULT_FD = cfg["result_fd"]
    nonce = sys.stdin.readline().strip()
    close_other_fds()
    mode = cfg["mode"]
    drop = cfg["drop_uid"] if os.geteuid() == 0 else None
    namespaces, why = enter_namespaces(nonce, cfg, mode, drop)
    if not namespaces:
        # No uid change: as root, the interpreter's own folder may be closed to an unprivileged uid.
        uid = f"uid={os.getuid()}"
        os.chdir(cfg["workdir"])
        write_result(nonce, "setup", f"audit-hook (no namespaces: {why or 'not asked for'}) {uid}")
        judge(nonce, cfg, audit=True)
    reaper = os.fork()
    if reaper:
        # The parent kills the reaper at its wall budget: the kernel then kills the whole pid namespace and
        # this process reaps the reaper and exits, leaving no orphan behind.
        write_result(nonce, "reaper", reaper)
        os._exit(reap(reaper))
    # pid 1 of the new pid namespace: build the root, start the program, exit when it ends.
    described = build_pid1_root(nonce, cfg, mode)
    program_uid = drop if drop is not None else os.getuid()
    write_result(nonce, "setup", f"namespaces(user,net,mount,pid) {described} uid={program_uid}")
    tests = os.fork()
    if tests == 0:
        if drop is not None:
            drop_root(drop)  # all three uids: capabilities go with them (the program inherits this uid)
        check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "pdeathsig")
        judge(nonce, cfg, audit=False)
    os._exit(reap(tests))


if __name__ == "__main__":
    main()
