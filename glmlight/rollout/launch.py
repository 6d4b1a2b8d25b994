"""Servers glmlight starts itself (`rollout.server.launch=true`): a child process glmlight always
reaps, its log captured to a file, its exit detected; and the addresses a launch or a
weight-update rendezvous needs.

A managed server runs under `server_guard.py` (standard library only), which leads its own
process group and holds the read end of a pipe whose write end only this process holds. The
server and everything it starts (vLLM's engine core and workers, SGLang's schedulers) are
stopped when
- `close()` / `stop()` is called (the engines call it from their own close(), `Run.fit()` closes
  the engines when it ends, however it ends);
- this interpreter exits without closing them (an atexit hook stops every live server);
- this process dies in any other way, SIGKILL included: the pipe reads EOF in the guard;
- the guard itself is killed: the server has PR_SET_PDEATHSIG = SIGTERM.
Every process of a managed server carries `GLMLIGHT_SERVER_ID=<id>` in its environment, so a
leftover could be found (tests scan /proc for it).
"""

from __future__ import annotations

import atexit
import os
import signal
import socket
import subprocess
import sys
import threading
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

from glmlight.errors import EngineError

GUARD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "server_guard.py")
# The directory that holds the glmlight package: put on a server's PYTHONPATH so that a worker
# extension (glmlight.rollout.vllm_worker) imports in the server's own environment.
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SERVER_ID_ENV = "GLMLIGHT_SERVER_ID"

_live: set["ManagedServer"] = set()
_live_lock = threading.Lock()


@dataclass
class LaunchSpec:
    """How to start one server as a child process."""

    name: str
    command: list[str]
    host: str
    port: int
    log_path: str
    env: dict[str, str] = field(default_factory=dict)
    secrets: tuple[str, ...] = ()  # redacted from anything we print
    grace_s: float = 10.0  # SIGTERM, then SIGKILL after this long

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> ManagedServer:
        return ManagedServer(self)


def python_path_with_package(env: dict[str, str] | None = None) -> str:
    """PYTHONPATH for a server that must import glmlight's worker extension: this glmlight's
    package root first, then whatever PYTHONPATH the server would have had."""
    rest = (env or {}).get("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    parts = [PACKAGE_ROOT] + [p for p in rest.split(os.pathsep) if p and p != PACKAGE_ROOT]
    return os.pathsep.join(parts)


class ManagedServer:
    """A server under `server_guard.py` (own process group), stdout+stderr captured to `log_path`."""

    def __init__(self, spec: LaunchSpec):
        self.spec = spec
        self.server_id = uuid.uuid4().hex[:16]
        os.makedirs(os.path.dirname(os.path.abspath(spec.log_path)), exist_ok=True)
        self._log = open(spec.log_path, "ab")
        read_end, self._watch = os.pipe()  # both non-inheritable: only the guard gets read_end
        command = [sys.executable, GUARD, str(read_end), f"{spec.grace_s:g}", "--", *spec.command]
        try:
            self.proc = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env={**os.environ, **spec.env, SERVER_ID_ENV: self.server_id},
                                         start_new_session=True, pass_fds=(read_end,))
        except OSError as e:
            self._log.close()
            os.close(self._watch)
            raise EngineError(f"cannot start the {spec.name} server ({self._redact(' '.join(spec.command[:3]))}...): {e}") from None
        finally:
            os.close(read_end)
        with _live_lock:
            _live.add(self)

    @property
    def pgid(self) -> int:
        return self.proc.pid

    def check(self) -> None:
        """Raise a one-line EngineError with the log tail if the server has exited."""
        rc = self.proc.poll()
        if rc is not None:
            code = f"signal {rc - 128}" if rc > 128 else (f"signal {-rc}" if rc < 0 else f"code {rc}")
            raise EngineError(f"managed {self.spec.name} server exited with {code}; last log lines: "
                              f"{self.log_tail()} (full log: {self.spec.log_path})")

    def log_tail(self, n: int = 6) -> str:
        try:
            with open(self.spec.log_path, "rb") as f:
                f.seek(max(0, os.path.getsize(self.spec.log_path) - 8192))
                lines = [ln.strip() for ln in f.read().decode("utf-8", "replace").splitlines() if ln.strip()]
        except OSError:
            return "(no log)"
        return self._redact(" | ".join(lines[-n:])) or "(empty log)"

    def _redact(self, text: str) -> str:
        for secret in self.spec.secrets:
            if secret:
                text = text.replace(secret, "***")
        return text

    def stop(self, timeout_s: float | None = None) -> None:
        """SIGTERM to the server's process group (the guard stops the rest), SIGKILL to the group
        if it is still there after the guard's grace period; idempotent."""
        wait = (timeout_s if timeout_s is not None else self.spec.grace_s) + 5.0
        for sig, seconds in ((signal.SIGTERM, wait), (signal.SIGKILL, 5.0)):
            if not _group_exists(self.pgid):
                break
            try:
                os.killpg(self.pgid, sig)
            except (ProcessLookupError, PermissionError):
                break
            try:
                self.proc.wait(seconds)
            except subprocess.TimeoutExpired:
                continue
            if not _group_exists(self.pgid):
                break
        try:
            self.proc.wait(5.0)
        except subprocess.TimeoutExpired:
            pass
        if self._watch is not None:
            os.close(self._watch)
            self._watch = None
        self._log.close()
        with _live_lock:
            _live.discard(self)


def server_processes(server_id: str) -> list[int]:
    """Live processes (zombies excluded) that carry GLMLIGHT_SERVER_ID=server_id: a managed server's
    guard, the server and everything it started. Linux /proc; [] elsewhere."""
    marker = f"{SERVER_ID_ENV}={server_id}".encode()
    found = []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if marker not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{entry}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    continue
        except OSError:
            continue
        found.append(int(entry))
    return found


def _group_exists(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


@atexit.register
def _stop_all() -> None:
    with _live_lock:
        servers = list(_live)
    for server in servers:
        try:
            server.stop()
        except Exception:  # noqa: BLE001 - exiting
            pass


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def local_ip_towards(url: str) -> str:
    """This host's address on the route to `url` (where a server can reach our rendezvous)."""
    host = urlparse(url).hostname or "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((host, 9))
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def launch_target(urls: Sequence[str]) -> tuple[str, int]:
    """Host and port for a managed server: those of urls[0], or 127.0.0.1 and a free port."""
    if urls:
        u = urlparse(urls[0])
        return u.hostname or "127.0.0.1", u.port or free_port()
    return "127.0.0.1", free_port()




def log_path_for(cfg: Any, name: str, port: int) -> str:
    root = cfg.rollout.server.launch_log_dir or cfg.trainer.default_root_dir
    return os.path.join(root, f"{name}-server-{port}.log")
