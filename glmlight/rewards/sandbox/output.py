"""What the sandboxed program wrote (bounded, pumped without blocking) and the result a run reports:
exit status, limits it hit, its output."""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import time

from glmlight.rewards.sandbox.config import (
    FULL_NAMESPACES,
    SandboxConfig,
    SandboxResult,
)


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


class Pipes:
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
            if left <= 0 or (stop_on_exit and exited(self.proc.pid)):
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


def _violations(sig: int | None, timed_out: bool, pipes: Pipes, duration: float, cfg: SandboxConfig) -> list[str]:
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


def make_result(rc: int, pipes: Pipes, timed_out: bool, duration: float, cfg: SandboxConfig,
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


def exited(pid: int) -> bool:
    """Whether child `pid` has exited, without reaping it."""
    return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
