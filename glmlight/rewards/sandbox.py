"""Run untrusted Python code in a subprocess under OS-level limits.

`run_sandboxed(code, stdin)` writes `code` to a fresh temporary directory and
runs it with the current interpreter in isolated mode (`-I -S`), feeding
`stdin` and capturing a bounded amount of stdout/stderr. The layers, each used
when the machine allows it (docs/code_reward.md says what that buys and what it
does not):

- resource limits (CPU time, address space, file size, processes, open files,
  no core dumps), a wall-clock timeout that kills everything the program
  started, and a clean environment (no parent variables, so no secrets);
- when running as root: a fresh unprivileged uid/gid per run (cannot signal
  the parent, cannot write files it does not own, per-run process accounting);
- Linux namespaces: network (only a down loopback device), mount (read-only
  view of the host, private size-capped scratch tmpfs at /tmp), pid (the
  program sees only its own processes; all die with it) and IPC.

Setup happens in a small launcher process (this very file run as a script) so
the parent never forks with `preexec_fn`, which is unsafe in a threaded
process. Which namespaces work is probed once per process; if network
isolation is unavailable, one warning says so and `network_isolated` is False.

This module imports only the standard library: the launcher runs it with
`python -I -S`.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import logging
import os
import random
import re
import resource
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("glmlight.rewards.sandbox")

PROGRAM_NAME = "main.py"
SAFE_PATH = "/usr/local/bin:/usr/bin:/bin"
# World-writable scratch directories that the mount namespace replaces with the private tmpfs.
SCRATCH_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")
FULL_NAMESPACES = ("net", "mount", "pid", "ipc")
# Tried in order by the probe; the first that runs a program wins.
NAMESPACE_CANDIDATES: tuple[tuple[str, ...], ...] = (FULL_NAMESPACES, ("net",), ())

_PROBE_PROGRAM = "import socket\nnames = [n for _, n in socket.if_nameindex()]\nassert names == ['lo'], names\n"


class SandboxError(RuntimeError):
    """The sandbox itself is broken (cannot spawn or set up), as opposed to a failing program."""


@dataclass(frozen=True)
class SandboxConfig:
    """Limits and isolation switches for one sandboxed run; every field has a sane default."""

    timeout_s: float = 5.0  # wall clock, from spawn to kill
    cpu_s: int = 5  # RLIMIT_CPU: SIGXCPU at cpu_s, SIGKILL one second later
    memory_mb: int = 512  # RLIMIT_AS (virtual address space)
    file_size_mb: int = 16  # RLIMIT_FSIZE: largest file the program may write
    max_procs: int = 32  # RLIMIT_NPROC (processes + threads of the sandbox uid)
    max_open_files: int = 64  # RLIMIT_NOFILE
    max_output_bytes: int = 1 << 20  # kept per stream; the rest is read and discarded
    scratch_mb: int = 64  # size of the private /tmp tmpfs (mount namespace only)
    namespaces: bool = True  # use net/mount/pid/ipc namespaces where they work
    drop_privileges: bool = True  # when root, run as a fresh unprivileged uid
    require_network_isolation: bool = False  # raise SandboxError instead of running without it
    uid_range: tuple[int, int] = (1_000_000, 2_000_000)  # uids/gids drawn for runs (root only)
    python: str | None = None  # interpreter for the program; default: this one
    workdir_root: str | None = None  # parent of the per-run temp dir; default: tempfile's


@dataclass
class SandboxResult:
    """What a sandboxed run did. `returncode` < 0 means killed by that signal (like subprocess)."""

    returncode: int
    stdout: str
    stderr: str
    timed_out: bool
    killed_by_signal: int | None
    duration_s: float
    network_isolated: bool
    violations: list[str] = field(default_factory=list)
    output_truncated: bool = False
    isolation: tuple[str, ...] = ()  # active layers: "uid", "net", "mount", "pid", "ipc"
    uid: int | None = None  # the unprivileged uid the program ran as (None: the caller's)

    @property
    def ok(self) -> bool:
        """Exited 0 within every limit."""
        return self.returncode == 0 and not self.timed_out and not self.output_truncated


def run_sandboxed(code: str, stdin: str = "", *, config: SandboxConfig | None = None, **overrides: Any) -> SandboxResult:
    """Run Python `code` with `stdin` in the sandbox; keyword overrides replace `config` fields.

    A failing, hostile or runaway program is reported in the result; only a
    broken sandbox (cannot spawn, setup failed) raises `SandboxError`.
    """
    cfg = dataclasses.replace(config or SandboxConfig(), **overrides)
    namespaces = available_namespaces(cfg)
    if cfg.require_network_isolation and "net" not in namespaces:
        raise SandboxError("network isolation is required but unavailable on this machine")
    return _run_once(code, stdin, cfg, namespaces)


# ---------------------------------------------------------------------------------------------
# Probe: which namespaces work here (once per process and interpreter)

_probe_lock = threading.Lock()
_probe_cache: dict[tuple, tuple[frozenset[str] | None, str]] = {}
_warned = False


def available_namespaces(cfg: SandboxConfig | None = None) -> frozenset[str]:
    """The namespaces runs will use; probed once and cached. Raises SandboxError if nothing runs."""
    cfg = cfg or SandboxConfig()
    if not cfg.namespaces:
        return frozenset()
    key = (_interpreter(cfg), _will_drop_privileges(cfg), cfg.workdir_root)
    with _probe_lock:
        if key not in _probe_cache:
            _probe_cache[key] = _probe(cfg)
        found, reasons = _probe_cache[key]
    if found is None:
        raise SandboxError(f"cannot run a sandboxed program on this machine: {reasons}")
    return found


def _probe(cfg: SandboxConfig) -> tuple[frozenset[str] | None, str]:
    probe_cfg = dataclasses.replace(cfg, timeout_s=max(cfg.timeout_s, 20.0), cpu_s=max(cfg.cpu_s, 10))
    reasons: list[str] = []
    for candidate in NAMESPACE_CANDIDATES:
        program = _PROBE_PROGRAM if "net" in candidate else "pass\n"
        try:
            res = _run_once(program, "", probe_cfg, frozenset(candidate))
        except SandboxError as e:
            reasons.append(f"[{'+'.join(candidate) or 'no namespaces'}] {e}")
            continue
        if res.returncode == 0:
            _warn_once(frozenset(candidate), reasons)
            return frozenset(candidate), ""
        tail = res.stderr.strip().splitlines()[-1:] or [f"exit {res.returncode}"]
        reasons.append(f"[{'+'.join(candidate) or 'no namespaces'}] {tail[0]}")
    return None, "; ".join(reasons)


def _warn_once(found: frozenset[str], reasons: list[str]) -> None:
    global _warned
    missing = [ns for ns in FULL_NAMESPACES if ns not in found]
    if not missing or _warned:
        return
    _warned = True
    if "net" in missing:
        what = "network isolation is unavailable: sandboxed programs CAN open network connections"
    else:
        what = f"{'/'.join(missing)} namespaces are unavailable: weaker filesystem/process isolation"
    log.warning("code sandbox: %s (%s)", what, "; ".join(reasons) or "probe failed")


# ---------------------------------------------------------------------------------------------
# One run: workdir, identity, launcher process, supervision, cleanup


def _run_once(code: str, stdin: str, cfg: SandboxConfig, namespaces: frozenset[str]) -> SandboxResult:
    with _sandbox_uid(cfg) as uid:
        workdir = _make_workdir(cfg, uid)
        try:
            with open(os.path.join(workdir, PROGRAM_NAME), "w", encoding="utf-8", errors="replace") as f:
                f.write(code)
            spec = _launch_spec(cfg, namespaces, uid, workdir)
            return _supervise(spec, stdin.encode("utf-8", "replace"), cfg, namespaces, uid)
        finally:
            _remove_tree(workdir)
            if uid is not None and "mount" not in namespaces:
                _remove_scratch_leftovers(uid)


def _interpreter(cfg: SandboxConfig) -> str:
    return os.path.realpath(cfg.python or sys.executable)


def _will_drop_privileges(cfg: SandboxConfig) -> bool:
    return cfg.drop_privileges and os.geteuid() == 0


class _UidPool:
    """Hands out uids no process of ours uses and no process on the machine runs as."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._in_use: set[int] = set()

    def acquire(self, lo: int, hi: int) -> int:
        for _ in range(1000):
            uid = random.randrange(lo, hi)
            with self._lock:
                if uid in self._in_use:
                    continue
                self._in_use.add(uid)
            if not processes_of_uid(uid):
                return uid
            self.release(uid)
        raise SandboxError(f"no free sandbox uid in range [{lo}, {hi})")

    def release(self, uid: int) -> None:
        with self._lock:
            self._in_use.discard(uid)


_uids = _UidPool()


@contextmanager
def _sandbox_uid(cfg: SandboxConfig) -> Iterator[int | None]:
    if not _will_drop_privileges(cfg):
        yield None
        return
    uid = _uids.acquire(*cfg.uid_range)
    try:
        yield uid
    finally:
        _uids.release(uid)


def _make_workdir(cfg: SandboxConfig, uid: int | None) -> str:
    workdir = tempfile.mkdtemp(prefix="glmlight-sbx-", dir=cfg.workdir_root)
    if uid is not None:
        os.chown(workdir, uid, uid)
    os.chmod(workdir, 0o700)
    return workdir


def _remove_tree(path: str) -> None:
    """rmtree that also copes with directories the program made unreadable (non-root runs)."""

    def fix_and_retry(func, p, _exc):
        if os.geteuid() == 0 or os.path.islink(p):  # root needs no chmod; never chmod through a link
            return
        try:
            os.chmod(os.path.dirname(p), 0o700)
            if os.path.isdir(p):
                os.chmod(p, 0o700)
            func(p)
        except OSError:
            pass

    shutil.rmtree(path, onerror=fix_and_retry)
    if os.path.exists(path):
        shutil.rmtree(path, ignore_errors=True)


def _hidden_prefix(python: str) -> tuple[str, str] | None:
    """(mask, prefix) when an ancestor of the interpreter's prefix is closed to other users.

    With a mount namespace the launcher puts an empty tmpfs on `mask` and binds
    only `prefix` back, so the unprivileged uid can run the interpreter without
    seeing the rest of `mask` (e.g. an interpreter under /root).
    """
    if python == os.path.realpath(sys.executable):
        prefix = os.path.realpath(sys.base_prefix)
    else:
        prefix = os.path.dirname(os.path.dirname(python))
    parts = prefix.strip("/").split("/")
    for i in range(1, len(parts)):
        ancestor = "/" + "/".join(parts[:i])
        try:
            closed = not os.stat(ancestor).st_mode & stat.S_IXOTH
        except OSError:
            return None  # a missing interpreter fails at exec, with its own message
        if closed:
            return ancestor, prefix
    return None


def _rlimits(cfg: SandboxConfig, uid: int | None) -> list[list[int]]:
    mb = 1024 * 1024
    nproc = cfg.max_procs
    if uid is None:  # RLIMIT_NPROC counts all tasks of the caller's uid: allow for those already running
        nproc += tasks_of_uid(os.getuid())
    return [
        [resource.RLIMIT_CPU, cfg.cpu_s, cfg.cpu_s + 1],
        [resource.RLIMIT_AS, cfg.memory_mb * mb, cfg.memory_mb * mb],
        [resource.RLIMIT_FSIZE, cfg.file_size_mb * mb, cfg.file_size_mb * mb],
        [resource.RLIMIT_NPROC, nproc, nproc],
        [resource.RLIMIT_NOFILE, cfg.max_open_files, cfg.max_open_files],
        [resource.RLIMIT_CORE, 0, 0],
    ]


def _launch_spec(cfg: SandboxConfig, namespaces: frozenset[str], uid: int | None, workdir: str) -> dict[str, Any]:
    python = _interpreter(cfg)
    expose = None
    if uid is not None:
        expose = _hidden_prefix(python)
        if expose and "mount" not in namespaces:
            raise SandboxError(
                f"interpreter prefix {expose[1]} is not reachable by an unprivileged uid ({expose[0]} is closed) "
                "and no mount namespace is available: set SandboxConfig.python to a world-readable interpreter"
            )
    cwd = "/tmp" if "mount" in namespaces else workdir
    return {
        "python": python,
        "argv": [python, "-I", "-S", "-B", os.path.join(cwd, PROGRAM_NAME)],
        "env": _clean_env(cwd),
        "cwd": cwd,
        "workdir": workdir,
        "namespaces": sorted(namespaces),
        "uid": uid,
        "rlimits": _rlimits(cfg, uid),
        "expose": expose,
        "scratch_mb": cfg.scratch_mb,
        "ppid": os.getpid(),
    }


def _clean_env(home: str) -> dict[str, str]:
    """The whole environment of the program: nothing is inherited from the parent."""
    return {"PATH": SAFE_PATH, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "HOME": home, "TMPDIR": home}


class _Capped:
    """Keeps the first `limit` bytes of a stream and counts the rest."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.data = bytearray()
        self.total = 0

    def feed(self, chunk: bytes) -> None:
        self.total += len(chunk)
        room = self.limit - len(self.data)
        if room > 0:
            self.data += chunk[:room]

    @property
    def truncated(self) -> bool:
        return self.total > self.limit

    def text(self) -> str:
        return self.data.decode("utf-8", "replace")


class _Pipes:
    """Feeds stdin and drains stdout/stderr of a process without threads or unbounded buffers."""

    def __init__(self, proc: subprocess.Popen, stdin: bytes, limit: int) -> None:
        self.out, self.err = _Capped(limit), _Capped(limit)
        self.sel = selectors.DefaultSelector()
        self.sinks = {proc.stdout.fileno(): self.out, proc.stderr.fileno(): self.err}
        for fd in self.sinks:
            self.sel.register(fd, selectors.EVENT_READ)
        self.proc = proc
        self.pending = memoryview(stdin)
        if self.pending:
            os.set_blocking(proc.stdin.fileno(), False)
            self.sel.register(proc.stdin.fileno(), selectors.EVENT_WRITE)
        else:
            proc.stdin.close()

    def pump(self, until: float, stop_on_exit: bool) -> None:
        """Move data until every pipe is closed, `until` passes, or (optionally) the process exits."""
        while self.sel.get_map():
            left = until - time.monotonic()
            if left <= 0 or (stop_on_exit and _exited(self.proc.pid)):
                return
            for key, _ in self.sel.select(min(left, 0.05)):
                if key.fd in self.sinks:
                    self._read(key.fd)
                else:
                    self._write(key.fd)

    def _read(self, fd: int) -> None:
        chunk = os.read(fd, 1 << 16)
        if chunk:
            self.sinks[fd].feed(chunk)
        else:
            self.sel.unregister(fd)

    def _write(self, fd: int) -> None:
        try:
            n = os.write(fd, self.pending[: 1 << 16])
        except BlockingIOError:
            return
        except BrokenPipeError:
            n = len(self.pending)
        self.pending = self.pending[n:]
        if not self.pending:
            self.close_stdin()

    def close_stdin(self) -> None:
        stdin = self.proc.stdin
        if stdin is not None and not stdin.closed:
            if stdin.fileno() in self.sel.get_map():
                self.sel.unregister(stdin.fileno())
            try:
                stdin.close()
            except OSError:
                pass

    def close(self) -> None:
        self.close_stdin()
        self.sel.close()
        self.proc.stdout.close()
        self.proc.stderr.close()


def _supervise(spec: dict[str, Any], stdin: bytes, cfg: SandboxConfig, namespaces: frozenset[str], uid: int | None) -> SandboxResult:
    status_r, status_w = os.pipe()
    spec["status_fd"] = status_w
    start = time.monotonic()
    try:
        proc = subprocess.Popen(
            [os.path.realpath(sys.executable), "-I", "-S", "-B", os.path.abspath(__file__), json.dumps(spec)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            env=_clean_env("/"), cwd="/", pass_fds=(status_w,), start_new_session=True,
        )  # fmt: skip
    except OSError as e:
        os.close(status_r)
        raise SandboxError(f"cannot spawn the sandbox launcher: {e}") from e
    finally:
        os.close(status_w)
    pipes = _Pipes(proc, stdin, cfg.max_output_bytes)
    try:
        timed_out = _run_until_done(proc, pipes, start + cfg.timeout_s)
        _terminate(proc, uid)
        pipes.pump(time.monotonic() + 1.0, stop_on_exit=False)  # what is left in the pipes
    finally:
        pipes.close()
        _terminate(proc, uid)
        proc.wait()
        setup_error = _read_all(status_r)  # empty when the program was exec'd
    duration = time.monotonic() - start
    if setup_error:
        raise SandboxError(f"sandbox setup failed: {setup_error}")
    return _result(proc.returncode, pipes, timed_out, duration, cfg, namespaces, uid)


def _run_until_done(proc: subprocess.Popen, pipes: _Pipes, deadline: float) -> bool:
    """Pump I/O until the launcher exits or the deadline passes. Returns timed_out.

    The launcher is not reaped here, so its pid (the process group id) cannot be
    reused before `_terminate` signals the group.
    """
    pipes.pump(deadline, stop_on_exit=True)
    while not _exited(proc.pid):
        if time.monotonic() >= deadline:
            return True
        time.sleep(0.01)
    return False


def _exited(pid: int) -> bool:
    """Whether child `pid` has exited, without reaping it."""
    return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None


def _terminate(proc: subprocess.Popen, uid: int | None) -> None:
    """Kill the launcher's process group (leader not yet reaped), then anything left of the sandbox uid."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if uid is not None and not kill_uid(uid):
        log.warning("code sandbox: processes of uid %d survived repeated SIGKILL", uid)


def _remove_scratch_leftovers(uid: int) -> None:
    """Delete what the sandbox uid left at the top of the host's shared scratch dirs (no mount namespace)."""
    for scratch in SCRATCH_DIRS:
        try:
            entries = list(os.scandir(scratch))
        except OSError:
            continue
        for entry in entries:
            try:
                if entry.stat(follow_symlinks=False).st_uid != uid:
                    continue
                if entry.is_dir(follow_symlinks=False):
                    _remove_tree(entry.path)
                else:
                    os.unlink(entry.path)
            except OSError:
                pass


def _read_all(fd: int) -> str:
    chunks = []
    try:
        while chunk := os.read(fd, 1 << 16):
            chunks.append(chunk)
    finally:
        os.close(fd)
    return b"".join(chunks).decode("utf-8", "replace")


# Best-effort labels read off the program's stderr tail; scoring never depends on them.
_STDERR_LABELS = (
    ("MemoryError", "memory"),
    ("Resource temporarily unavailable", "processes"),
    ("can't start new thread", "processes"),
    ("No space left on device", "disk"),
    ("File too large", "file_size"),
    ("Too many open files", "open_files"),
    ("Operation not permitted", "permission"),
    ("Permission denied", "permission"),
    ("Read-only file system", "permission"),
    ("Network is unreachable", "network"),
    ("Connection refused", "network"),
    ("Temporary failure in name resolution", "network"),
)


def _violations(sig: int | None, timed_out: bool, pipes: _Pipes, duration: float, cfg: SandboxConfig) -> list[str]:
    found = []
    if timed_out:
        found.append("timeout")
    if sig == signal.SIGXCPU or (sig == signal.SIGKILL and not timed_out and duration >= cfg.cpu_s):
        found.append("cpu_time")
    if sig == signal.SIGXFSZ:
        found.append("file_size")
    if pipes.out.truncated or pipes.err.truncated:
        found.append("output_size")
    tail = bytes(pipes.err.data[-4096:]).decode("utf-8", "replace")
    for needle, label in _STDERR_LABELS:
        if needle in tail and label not in found:
            found.append(label)
    return found


def _result(rc: int, pipes: _Pipes, timed_out: bool, duration: float, cfg: SandboxConfig,
            namespaces: frozenset[str], uid: int | None) -> SandboxResult:  # fmt: skip
    sig = -rc if rc < 0 else None
    layers = (("uid",) if uid is not None else ()) + tuple(ns for ns in FULL_NAMESPACES if ns in namespaces)
    return SandboxResult(
        returncode=rc,
        stdout=pipes.out.text(),
        stderr=pipes.err.text(),
        timed_out=timed_out,
        killed_by_signal=sig,
        duration_s=duration,
        network_isolated="net" in namespaces,
        violations=_violations(sig, timed_out, pipes, duration, cfg),
        output_truncated=pipes.out.truncated or pipes.err.truncated,
        isolation=layers,
        uid=uid,
    )


# ---------------------------------------------------------------------------------------------
# /proc helpers (also useful to tests)


def _proc_status(pid: str) -> dict[str, str]:
    with open(f"/proc/{pid}/status", encoding="utf-8", errors="replace") as f:
        return dict(line.split(":", 1) for line in f if ":" in line)


def _live_tasks() -> Iterator[tuple[int, dict[str, str]]]:
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            st = _proc_status(entry.name)
        except OSError:
            continue
        if st.get("State", "").strip()[:1] not in ("Z", "X"):
            yield int(entry.name), st


def processes_of_uid(uid: int) -> list[int]:
    """Live (non-zombie) processes whose real or effective uid is `uid`."""
    return [pid for pid, st in _live_tasks() if str(uid) in st.get("Uid", "").split()[:2]]


def tasks_of_uid(uid: int) -> int:
    """Threads owned by real uid `uid` (what RLIMIT_NPROC counts)."""
    return sum(int(st.get("Threads", "1")) for _, st in _live_tasks() if st.get("Uid", "").split()[:1] == [str(uid)])


def kill_uid(uid: int, rounds: int = 100) -> bool:
    """SIGKILL every process of `uid` until none is left; False if some survive."""
    for _ in range(rounds):
        pids = processes_of_uid(uid)
        if not pids:
            return True
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.005)
    return not processes_of_uid(uid)


# ---------------------------------------------------------------------------------------------
# Launcher: runs as `python -I -S sandbox.py SPEC`, sets the sandbox up, then execs the program.
# Any setup error is written to the status pipe (closed on a successful exec) and exits 127.

CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWUSER = 0x00020000, 0x08000000, 0x10000000
CLONE_NEWPID, CLONE_NEWNET = 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_BIND, MS_REC, MS_PRIVATE = 4096, 16384, 1 << 18
# Per-mount flags a read-only remount must keep (they may be locked); equal to statvfs ST_* bits.
_KEEP_FLAGS = MS_NOSUID | MS_NODEV | MS_NOEXEC | 1024 | 2048 | 4096  # + NOATIME, NODIRATIME, RELATIME
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38
_NS_FLAGS = {"net": CLONE_NEWNET, "mount": CLONE_NEWNS, "pid": CLONE_NEWPID, "ipc": CLONE_NEWIPC}

_libc: Any = None


def _syscall(name: str, *args: Any) -> None:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    if getattr(_libc, name)(*args) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{name}{args!r}: {os.strerror(err)}")


def _c_str(text: str | None) -> bytes | None:
    return None if text is None else text.encode()


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    _syscall("mount", _c_str(source), _c_str(target), _c_str(fstype), ctypes.c_ulong(flags), _c_str(data))


def _prctl(option: int, value: int) -> None:
    _syscall("prctl", option, ctypes.c_ulong(value), ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0))


def _launcher_main(spec: dict[str, Any]) -> None:
    status_fd = spec["status_fd"]
    os.set_inheritable(status_fd, False)
    try:
        _launch(spec, status_fd)
    except BaseException as e:  # noqa: BLE001 - report every setup failure to the parent
        os.write(status_fd, f"{type(e).__name__}: {e}".encode()[:4000])
        os._exit(127)


def _launch(spec: dict[str, Any], status_fd: int) -> None:
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # die with the supervising parent
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    namespaces = set(spec["namespaces"])
    program = _read_program(spec)
    if namespaces:
        _enter_namespaces(namespaces)
    if "pid" in namespaces:
        _spawn_in_pid_namespace(spec, status_fd, program)  # returns only in the program's process
    else:
        if "mount" in namespaces:
            _setup_mounts(spec, program, new_proc=False)
        _become_sandboxed(spec)
        _exit_if_orphaned(spec)
    os.execve(spec["python"], spec["argv"], spec["env"])


def _read_program(spec: dict[str, Any]) -> bytes:
    with open(os.path.join(spec["workdir"], PROGRAM_NAME), "rb") as f:
        return f.read()


def _enter_namespaces(namespaces: set[str]) -> None:
    flags = 0
    for ns in namespaces:
        flags |= _NS_FLAGS[ns]
    if os.geteuid() == 0:
        _syscall("unshare", flags)
        return
    uid, gid = os.getuid(), os.getgid()  # unprivileged: a user namespace mapping us to ourselves
    _syscall("unshare", flags | CLONE_NEWUSER)
    for path, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
        with open(f"/proc/self/{path}", "w") as f:
            f.write(text)


def _spawn_in_pid_namespace(spec: dict[str, Any], status_fd: int, program: bytes) -> None:
    """launcher (relay) -> init (pid 1: mounts, reaps) -> program. Returns in the program's process.

    The program is not pid 1, so kernel signals such as SIGXCPU reach it; when
    it exits, init exits and the kernel kills whatever is left in the namespace.
    """
    report_r, report_w = os.pipe()  # init -> relay: the program's wait status
    alive_r, alive_w = os.pipe()  # relay -> init: EOF once the relay is gone
    if os.fork():
        os.close(status_fd)
        os.close(report_w)
        os.close(alive_r)
        _relay_exit(report_r)
    os.close(report_r)
    os.close(alive_w)
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if _pipe_closed(alive_r):  # the relay died before the death signal was armed
        os._exit(1)
    if "mount" in spec["namespaces"]:
        _setup_mounts(spec, program, new_proc=True)
    child = os.fork()
    if child == 0:
        os.close(report_w)
        os.close(alive_r)
        _become_sandboxed(spec)
        return
    os.close(status_fd)
    _reap_until(child, report_w)


def _pipe_closed(fd: int) -> bool:
    os.set_blocking(fd, False)
    try:
        return os.read(fd, 1) == b""
    except BlockingIOError:
        return False


def _reap_until(child: int, report_w: int) -> None:
    """As init: reap every orphan; when the program exits, report its status and exit."""
    while True:
        pid, status = os.waitpid(-1, 0)
        if pid == child:
            os.write(report_w, str(status).encode())
            os._exit(0)


def _relay_exit(report_r: int) -> None:
    """Wait for init and leave the way the program did (its signal or its exit code)."""
    _, status = os.wait()
    report = os.read(report_r, 64)
    if report:
        status = int(report)
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [sig])
        os.kill(os.getpid(), sig)
        os._exit(128 + sig)
    os._exit(os.waitstatus_to_exitcode(status))


def _setup_mounts(spec: dict[str, Any], program: bytes, new_proc: bool) -> None:
    """Private, read-only view of the host; a size-capped tmpfs for every scratch dir; own /proc."""
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing below propagates back to the host
    if spec["expose"]:
        _expose_prefix(*spec["expose"])
    uid = spec["uid"] if spec["uid"] is not None else os.getuid()
    gid = spec["uid"] if spec["uid"] is not None else os.getgid()
    _mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"size={spec['scratch_mb']}m,mode=0700,uid={uid},gid={gid}")
    path = os.path.join("/tmp", PROGRAM_NAME)
    with open(path, "wb") as f:
        f.write(program)
    os.chown(path, uid, gid)
    scratch = ["/tmp"]
    for d in SCRATCH_DIRS[1:]:
        if os.path.isdir(d) and not os.path.islink(d):
            _mount("/tmp", d, None, MS_BIND)
            scratch.append(d)
    _remount_all_readonly(skip=set(scratch))
    if new_proc:
        _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)


def _expose_prefix(mask: str, prefix: str) -> None:
    """Cover `mask` with an empty tmpfs and bind only the interpreter `prefix` back into it."""
    fd = os.open(prefix, os.O_PATH | os.O_DIRECTORY)
    try:
        _mount("tmpfs", mask, "tmpfs", MS_NOSUID | MS_NODEV, "size=64k,mode=0755")
        os.makedirs(prefix, mode=0o755, exist_ok=True)
        _mount(f"/proc/self/fd/{fd}", prefix, None, MS_BIND | MS_REC)
    finally:
        os.close(fd)


def _mount_points() -> list[str]:
    points = []
    with open("/proc/self/mountinfo", encoding="utf-8") as f:
        for line in f:
            raw = line.split()[4]
            points.append(re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), raw))  # e.g. \040
    return points


def _remount_all_readonly(skip: set[str]) -> None:
    for point in _mount_points():
        if point in skip:
            continue
        keep = os.statvfs(point).f_flag & _KEEP_FLAGS
        _mount(None, point, None, MS_REMOUNT | MS_BIND | MS_RDONLY | keep)


def _become_sandboxed(spec: dict[str, Any]) -> None:
    """Limits, the unprivileged identity, no privilege gain, default signals, the program's cwd."""
    for res, soft, hard in spec["rlimits"]:
        resource.setrlimit(res, (soft, hard))
    if spec["uid"] is not None:
        os.setgroups([])
        os.setresgid(spec["uid"], spec["uid"], spec["uid"])
        os.setresuid(spec["uid"], spec["uid"], spec["uid"])
    _prctl(PR_SET_NO_NEW_PRIVS, 1)
    for sig in (signal.SIGPIPE, signal.SIGXFSZ):
        signal.signal(sig, signal.SIG_DFL)
    os.chdir(spec["cwd"])


def _exit_if_orphaned(spec: dict[str, Any]) -> None:
    """Re-arm the death signal (a credential change cleared it) and close the race with the parent."""
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != spec["ppid"]:
        os._exit(1)


if __name__ == "__main__":
    _launcher_main(json.loads(sys.argv[1]))
