"""Server-backed rollout engines: `build_server_engine` plus what SGLang and vLLM share.

- `build_server_engine(cfg, tokenizer)`: validate `cfg.rollout.server` and build the
  engine for `cfg.rollout.backend` (sglang | vllm | vllm_ascend).
- `ServerEngineBase`: URLs and routing, readiness wait, request ids and the
  rid-keyed gather (every prompt's answer comes back exactly once, in order), the
  weight-sync skeleton (pause → push → flush → resume → confirm version), close().
- `LaunchSpec` / `ManagedServer`: an optional server started as a child process,
  its log captured to a file, its exit detected, terminated on close().

This module imports nothing heavy at import time; the engines import aiohttp.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import time
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

from glmlight.errors import ConfigError, EngineError
from glmlight.rollout.base import NamedTensors, SamplingParams, normalize_requests

BACKENDS = ("sglang", "vllm", "vllm_ascend")
WEIGHT_SYNC_MODES = ("disk", "tensor", "distributed")


def build_server_engine(cfg: Any, tokenizer: Any = None):
    """The RolloutEngine for `cfg.rollout.backend`; `cfg` is the whole validated config.

    `tokenizer` is accepted for symmetry with the embedded engine; server engines work
    on token ids only and never re-tokenize.
    """
    r, s = cfg.rollout, cfg.rollout.server
    if r.backend not in BACKENDS:
        raise ConfigError(f"config error: rollout.backend={r.backend!r} is not a server backend; choose one of {list(BACKENDS)}")
    in_process = bool(s.in_process)
    if not s.urls and not s.launch and not in_process:
        raise ConfigError(f"config error: rollout.backend={r.backend} needs rollout.server.urls (running servers) "
                          "or rollout.server.launch=true (start one)")
    if s.weight_sync not in WEIGHT_SYNC_MODES:
        raise ConfigError(f"config error: rollout.server.weight_sync={s.weight_sync!r} is not one of {list(WEIGHT_SYNC_MODES)}")
    if (s.launch or in_process) and not (s.model_path or cfg.model.path):
        raise ConfigError("config error: rollout.server.launch needs rollout.server.model_path or model.path "
                          "(the checkpoint directory the server loads)")
    if s.router and s.launch:
        raise ConfigError("config error: rollout.server.router and rollout.server.launch cannot both be set")
    try:
        import aiohttp  # noqa: F401
    except ImportError:
        raise ConfigError(f"config error: rollout.backend={r.backend} needs aiohttp; "
                          f"pip install 'glmlight[{r.backend.split('_')[0]}]'") from None
    if r.backend == "sglang":
        from glmlight.rollout.sglang import SGLangEngine

        return SGLangEngine.from_config(cfg)
    if in_process:
        from glmlight.rollout.vllm import VLLMInProcessEngine

        return VLLMInProcessEngine.from_config(cfg)
    from glmlight.rollout.vllm import VLLMEngine

    return VLLMEngine.from_config(cfg)


# ---------------------------------------------------------------------- managed launch
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


# ---------------------------------------------------------------------- shared engine
class ServerEngineBase:
    """URLs, HTTP client, readiness, rid-keyed gather and the weight-sync skeleton.

    Subclasses set `name` / `health_path` and implement the protocol hooks:
    `_generate_one`, `_score_one`, `_pause`, `_flush`, `_resume`, `_push`, `_served_version`.
    """

    name = "server"
    health_path = "/health"

    def __init__(self, urls: Sequence[str], *, router: bool = False, http: Any = None, launch: LaunchSpec | None = None,
                 ready_timeout_s: float = 900.0, version: int = 0, confirm_timeout_s: float | None = None,
                 poll_interval_s: float = 0.05):
        from glmlight.rollout.http import HttpClient, HttpSettings, UrlPool

        self.launcher: ManagedServer | None = None
        self._closed = False
        self.http = HttpClient(self.name, http or HttpSettings(), on_connection_error=self._check_launcher)
        try:
            if launch is not None:
                self.launcher = launch.start()
                urls = [launch.url]
            self.urls = list(urls)
            self.router = router
            self.pool = UrlPool(self.urls[:1] if router else self.urls)
            self._version = version
            self.confirm_timeout_s = confirm_timeout_s or self.http.settings.timeout_s
            self.poll_interval_s = poll_interval_s
            self.num_duplicates = 0
            for url in self.urls:
                self._wait_ready(url, ready_timeout_s)
            self._after_ready()
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ protocol
    @property
    def version(self) -> int:
        return self._version

    def generate(self, prompts: list[list[int]], params: SamplingParams | Sequence[SamplingParams]) -> list:
        self._check_open()
        if not prompts:
            return []
        params = normalize_requests(prompts, params)
        from glmlight.rollout.http import new_rid

        version = self._version  # the weights every answer of this call is produced with
        jobs = [(rid, self._generate_one(rid, list(p), sp, version))
                for rid, p, sp in zip((new_rid() for _ in prompts), prompts, params)]
        return self.http.run(self._gather_by_rid(jobs))

    def score(self, prompts: list[list[int]], completions: list[list[int]]) -> list[list[float]]:
        self._check_open()
        if len(prompts) != len(completions):
            raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
        from glmlight.rollout.http import new_rid

        for i, p in enumerate(prompts):
            if not p:
                raise ValueError(f"prompt {i} is empty")
        jobs = [(rid, self._score_one(rid, list(p), list(c)))
                for rid, p, c in zip((new_rid() for _ in prompts), prompts, completions)]
        return self.http.run(self._gather_by_rid(jobs))

    def update_weights(self, named_tensors: NamedTensors | None = None, *, path: str | None = None, version: int) -> None:
        """pause → push weights → flush caches → resume, then wait until every server reports
        `version`; only then does `self.version` change."""
        self._check_open()
        if (named_tensors is None) == (path is None):
            raise ValueError("update_weights needs exactly one of named_tensors or path")
        urls = self.control_urls()
        named = list(named_tensors) if named_tensors is not None else None
        self._run_all(self._pause, urls)
        try:
            self._push(urls, named, path, version)
            self._run_all(self._flush, urls)
        except BaseException:
            try:
                self._run_all(self._resume, urls)
            except Exception:  # noqa: BLE001 - keep the original error
                pass
            raise
        self._run_all(self._resume, urls)
        self._confirm_version(urls, version)
        self._version = version

    def __enter__(self) -> "ServerEngineBase":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._before_close()
        finally:
            self.http.close()
            if self.launcher is not None:
                self.launcher.stop()

    # ------------------------------------------------------------------ helpers
    def _check_open(self) -> None:
        if self._closed:
            raise EngineError(f"the {self.name} engine is closed")

    def control_urls(self) -> list[str]:
        """The servers that receive weight updates: every URL, or in router mode the
        worker URLs listed after the router's."""
        if not self.router:
            return list(self.urls)
        if len(self.urls) < 2:
            raise EngineError(f"{self.name} router mode: weight sync needs the worker URLs after the router URL in "
                              "rollout.server.urls (the router only routes generation)")
        return list(self.urls[1:])

    def _check_launcher(self) -> None:
        if self.launcher is not None:
            self.launcher.check()

    def _wait_ready(self, url: str, timeout_s: float) -> None:
        from glmlight.rollout.http import ServerUnavailable

        deadline, refusals = time.monotonic() + timeout_s, 0
        while True:
            self._check_launcher()
            try:
                self.http.run(self.http.request(self.health_path, url=url, method="GET", expect_json=False,
                                                attempts=1, timeout_s=min(30.0, timeout_s)))
                return
            except ServerUnavailable as e:
                refusals += e.refused
                if e.refused and self.launcher is None and refusals > self.http.settings.max_retries:
                    raise EngineError(f"cannot reach {self.name} server at {url}: connection refused {refusals} times; "
                                      "is it running? (rollout.server.urls)") from None
                if time.monotonic() > deadline:
                    raise EngineError(f"{self.name} server at {url} did not become ready within {timeout_s:g}s "
                                      f"(last: {e})") from None
            time.sleep(min(max(self.http.settings.backoff_s, 0.01) * 2 ** min(refusals, 5), 0.5))

    def _after_ready(self) -> None:
        """Hook: look up what the engine needs once the servers answer (model name, version)."""

    def _before_close(self) -> None:
        """Hook: release protocol state (e.g. a weight-update process group)."""

    def _run_all(self, hook: Any, urls: Sequence[str]) -> None:
        async def all_() -> None:
            await asyncio.gather(*(hook(u) for u in urls))

        self.http.run(all_())

    def _confirm_version(self, urls: Sequence[str], version: int) -> None:
        deadline = time.monotonic() + self.confirm_timeout_s
        for url in urls:
            while True:
                served = self.http.run(self._served_version(url))
                if served == str(version):
                    break
                if time.monotonic() > deadline:
                    raise EngineError(f"{self.name} server at {url} still reports weight version {served!r} "
                                      f"{self.confirm_timeout_s:g}s after the update, expected {str(version)!r}")
                time.sleep(self.poll_interval_s)

    async def _gather_by_rid(self, jobs: list[tuple[str, Coroutine[Any, Any, Any]]]) -> list:
        """Run all jobs; results are keyed by request id, so an answer can be neither lost
        nor counted twice, and they come back in the order of `jobs`."""
        results: dict[str, Any] = {}

        async def run(rid: str, coro: Coroutine[Any, Any, Any]) -> None:
            value = await coro
            if rid in results:
                self.num_duplicates += 1
                return
            results[rid] = value

        outcomes = await asyncio.gather(*(run(rid, c) for rid, c in jobs), return_exceptions=True)
        errors = [o for o in outcomes if isinstance(o, BaseException)]
        if errors:
            raise next((e for e in errors if isinstance(e, EngineError)), errors[0])
        missing = [rid for rid, _ in jobs if rid not in results]
        if missing:
            raise EngineError(f"{self.name}: {len(missing)} of {len(jobs)} requests got no answer")
        return [results[rid] for rid, _ in jobs]

    # ------------------------------------------------------------------ hooks to implement
    async def _generate_one(self, rid: str, prompt: list[int], params: SamplingParams, version: int) -> Any:
        raise NotImplementedError

    async def _score_one(self, rid: str, prompt: list[int], completion: list[int]) -> list[float]:
        raise NotImplementedError

    async def _pause(self, url: str) -> None:
        raise NotImplementedError

    async def _flush(self, url: str) -> None:
        raise NotImplementedError

    async def _resume(self, url: str) -> None:
        raise NotImplementedError

    def _push(self, urls: Sequence[str], named: list | None, path: str | None, version: int) -> None:
        raise NotImplementedError

    async def _served_version(self, url: str) -> str | None:
        raise NotImplementedError


def sampling_fields(p: SamplingParams) -> dict[str, Any]:
    """The sampling fields SGLang and vLLM spell alike (top_k -1 = off for both)."""
    return {"temperature": p.temperature, "top_p": p.top_p, "top_k": p.top_k if p.top_k > 0 else -1,
            "stop_token_ids": list(p.stop_token_ids), "skip_special_tokens": False}


def server_settings(cfg: Any) -> dict[str, Any]:
    """Constructor arguments every server engine takes, from the whole config."""
    from glmlight.rollout.http import HttpSettings

    s = cfg.rollout.server
    return dict(urls=list(s.urls), router=bool(s.router), http=HttpSettings.from_config(s),
                ready_timeout_s=float(s.launch_timeout_s), weight_sync=s.weight_sync,
                weight_sync_dir=s.weight_sync_dir, model_path=s.model_path or cfg.model.path)


def log_path_for(cfg: Any, name: str, port: int) -> str:
    root = cfg.rollout.server.launch_log_dir or cfg.trainer.default_root_dir
    return os.path.join(root, f"{name}-server-{port}.log")
