"""One sandboxed run, supervised: the work dir and the identity (a fresh unprivileged uid when
root), the launcher process, its pipes under the limits, the kill of everything it started, and
the clean-up."""

from __future__ import annotations

import json
import logging
import os
import random
import resource
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
from typing import Any

from glmlight.rewards.sandbox import launcher
from glmlight.rewards.sandbox.config import (
    SAFE_PATH,
    SandboxConfig,
    SandboxError,
    SandboxResult,
)
from glmlight.rewards.sandbox.launcher import PROGRAM_NAME, SCRATCH_DIRS
from glmlight.rewards.sandbox.output import Pipes, exited, make_result
from glmlight.rewards.sandbox.procfs import kill_uid, processes_of_uid, tasks_of_uid

log = logging.getLogger("glmlight.rewards.sandbox")


def run_once(code: str, stdin: str, cfg: SandboxConfig, namespaces: frozenset[str]) -> SandboxResult:
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


def interpreter(cfg: SandboxConfig) -> str:
    return os.path.realpath(cfg.python or sys.executable)


def will_drop_privileges(cfg: SandboxConfig) -> bool:
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
    if not will_drop_privileges(cfg):
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
    python = interpreter(cfg)
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
        "env": clean_env(cwd),
        "cwd": cwd,
        "workdir": workdir,
        "namespaces": sorted(namespaces),
        "uid": uid,
        "rlimits": _rlimits(cfg, uid),
        "expose": expose,
        "scratch_mb": cfg.scratch_mb,
        "ppid": os.getpid(),
    }


def clean_env(home: str) -> dict[str, str]:
    """The whole environment of the program: nothing is inherited from the parent."""
    return {"PATH": SAFE_PATH, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "HOME": home, "TMPDIR": home}


def _supervise(spec: dict[str, Any], stdin: bytes, cfg: SandboxConfig, namespaces: frozenset[str], uid: int | None) -> SandboxResult:
    status_r, status_w = os.pipe()
    spec["status_fd"] = status_w
    start = time.monotonic()
    try:
        proc = subprocess.Popen(
            [os.path.realpath(sys.executable), "-I", "-S", "-B", os.path.abspath(launcher.__file__), json.dumps(spec)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            env=clean_env("/"), cwd="/", pass_fds=(status_w,), start_new_session=True,
        )  # fmt: skip
    except OSError as e:
        os.close(status_r)
        raise SandboxError(f"cannot spawn the sandbox launcher: {e}") from e
    finally:
        os.close(status_w)
    pipes = Pipes(proc, stdin, cfg.max_output_bytes)
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
    return make_result(proc.returncode, pipes, timed_out, duration, cfg, namespaces, uid)


def _run_until_done(proc: subprocess.Popen, pipes: Pipes, deadline: float) -> bool:
    """Pump I/O until the launcher exits or the deadline passes. Returns timed_out.

    The launcher is not reaped here, so its pid (the process group id) cannot be
    reused before `_terminate` signals the group.
    """
    pipes.pump(deadline, stop_on_exit=True)
    while not exited(proc.pid):
        if time.monotonic() >= deadline:
            return True
        time.sleep(0.01)
    return False


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
