"""The backend's own router in front of a managed fleet: sglang-router (SGLang) or vllm-router (vLLM), both
Rust load balancers from the package registry with cache-aware routing, launched and stopped by glmlight
(`rollout.server.router=sglang-router|vllm-router`). glmlight does not route: it starts the router with the
workers' URLs, sends generation to it, and takes a worker out of its rotation while the worker is restarted
and re-synced, then puts it back, through the router's worker API:

- vllm-router 0.1.17: `POST /remove_worker?url=`, `POST /add_worker?url=`, `GET /list_workers` ->
  {"urls": [...]} (vllm_router_rs, src/server.rs routes; `vllm-router --help`);
- sglang-router 0.3.2: `POST /add_worker?url=`, `POST /remove_worker?url=`, `GET /workers` -> {"workers":
  [{"url": ..., "is_healthy": ...}, ...]} (its README, "Administrative & Worker APIs").

Both take `--worker-urls URL...`, `--policy cache_aware`, `--host`, `--port`; both are started from the
server environment's `bin/` (the wheel's console script), or `rollout.server.router_command`.
"""

from __future__ import annotations

import json
import os
import sys
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from glmlight.engines.servers.launch import LaunchSpec, free_port, log_path_for
from glmlight.errors import EngineError

ROUTERS = ("sglang-router", "vllm-router")
BACKEND_OF = {"sglang-router": "sglang", "vllm-router": "vllm"}


def router_launch(cfg: Any, workers: list[str]) -> LaunchSpec:
    """The router of the run's config (`rollout.server.router`) in front of `workers`, on a free port of this host."""
    s = cfg.rollout.server
    host, port = "127.0.0.1", free_port()
    while any(w.endswith(f":{port}") for w in workers):
        port = free_port()
    cmd = router_command(str(s.router), s.launch_python, host, port, workers, list(s.router_args))
    return LaunchSpec(str(s.router), cmd, host, port, log_path_for(cfg, str(s.router), port))


def router_command(kind: str, python: str | None, host: str, port: int, workers: list[str], args: list[str]) -> list[str]:
    """The router's command line: its console script beside the server environment's Python (each router
    is installed in its server's environment), `--policy cache_aware` unless `args` chooses one."""
    if kind == "sglang-router":
        base = [python or sys.executable, "-m", "sglang_router.launch_router"]
    else:
        base = [os.path.join(os.path.dirname(python or sys.executable), "vllm-router")]
    policy = [] if "--policy" in args else ["--policy", "cache_aware"]
    return base + ["--host", host, "--port", str(port), "--worker-urls", *workers, *policy, *args]


class RouterAdmin:
    """Take a worker out of the router's rotation and put it back, through the router's own worker API."""

    def __init__(self, kind: str, url: str, timeout_s: float = 10.0):
        if kind not in ROUTERS:
            raise EngineError(f"unknown router {kind!r}: one of {', '.join(ROUTERS)}")
        self.kind, self.url, self.timeout_s = kind, url.rstrip("/"), timeout_s

    def _call(self, method: str, path: str, body: dict | None = None) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"} if data else {})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
                text = r.read().decode() or "null"
        except (urllib.error.URLError, OSError) as e:
            raise EngineError(f"{self.kind} at {self.url}: {method} {path} failed: {e}") from None
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            return text

    def workers(self) -> list[str]:
        """The worker URLs the router routes to now."""
        if self.kind == "vllm-router":
            return list((self._call("GET", "/list_workers") or {}).get("urls", []))
        return [w["url"] for w in (self._call("GET", "/workers") or {}).get("workers", [])]

    def remove(self, worker: str) -> None:
        if self.kind == "vllm-router":
            self._call("POST", "/remove_worker?url=" + urllib.parse.quote(worker, safe=""))
            return
        for w in (self._call("GET", "/workers") or {}).get("workers", []):
            if w.get("url") == worker:
                self._call("DELETE", f"/workers/{w['id']}")

    def add(self, worker: str) -> None:
        if self.kind == "vllm-router":
            self._call("POST", "/add_worker?url=" + urllib.parse.quote(worker, safe=""))
        else:
            self._call("POST", "/workers", {"url": worker})
