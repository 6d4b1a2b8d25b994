"""Servers glmlight starts itself (`rollout.server.launch=true`): a child process in its own
process group, its log captured to a file, its exit detected, stopped on close(); and the
addresses a launch or a weight-update rendezvous needs."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

from glmlight.errors import EngineError


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

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> ManagedServer:
        return ManagedServer(self)


class ManagedServer:
    """A server child process (own process group), stdout+stderr captured to `log_path`."""

    def __init__(self, spec: LaunchSpec):
        self.spec = spec
        os.makedirs(os.path.dirname(os.path.abspath(spec.log_path)), exist_ok=True)
        self._log = open(spec.log_path, "ab")
        try:
            self.proc = subprocess.Popen(spec.command, stdout=self._log, stderr=subprocess.STDOUT,
                                         env={**os.environ, **spec.env}, start_new_session=True)
        except OSError as e:
            self._log.close()
            raise EngineError(f"cannot start the {spec.name} server ({self._redact(' '.join(spec.command[:3]))}...): {e}") from None

    def check(self) -> None:
        """Raise a one-line EngineError with the log tail if the process has exited."""
        rc = self.proc.poll()
        if rc is not None:
            raise EngineError(f"managed {self.spec.name} server exited with code {rc}; last log lines: "
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

    def stop(self, timeout_s: float = 15.0) -> None:
        if self.proc.poll() is None:
            for sig, wait in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 5.0)):
                try:
                    os.killpg(self.proc.pid, sig)
                except (ProcessLookupError, PermissionError):
                    break
                try:
                    self.proc.wait(wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
        self._log.close()


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
