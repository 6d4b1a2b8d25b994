"""What the SGLang and vLLM engines share: `ServerEngineBase` — URLs and routing, readiness
wait, the rid-keyed gather (every prompt's answer comes back exactly once, in order), the
all-or-nothing weight update of the whole fleet, per-answer weight versions, and re-syncing a
server that restarted —, the sampling fields both spell alike, and the constructor settings read
from the config.

A weight update (`update_weights`):

    pause every server → push (the subclass's `_push`: all servers get the new weights, or every
    server is put back on the previous ones and `UpdateFailed` is raised) → flush caches →
    confirm every server reports the new version → resume → verify (a probe scored on every
    server: a server that acknowledged the version but still answers exactly as before did not
    load it)

A policy's MTP layers (`mtp.layers.{k}.*`) are sent under the names a checkpoint gives them,
`model.layers.{num_hidden_layers + k}.*` (glmlight.models.mtp), which the main-model loaders of SGLang 0.5.23 and
vLLM 0.32 skip for a checkpoint that declares them (config.json's num_nextn_predict_layers; read in their
sources, not run here); loading them into a speculating server's MTP draft is not built yet.

`UpdateFailed` is retried (`update_retries`); then the run stops with one line. `FleetFailed`
(servers left on different or unknown weights) stops it at once. Each server's answers carry the
version it reports for them (SGLang meta_info.weight_version(s), vLLM 0.33 weight_versions; vLLM
0.32: the version the server acknowledged last); an answer with another version than the one its
server must serve is never returned: the server is re-synced and the prompt asked again.

A server that drops or refuses connections, or answers with another version, is a suspect: before
the next call it is probed, and if it serves other weights than the current version (it
restarted) it gets the current weights again (`resync`) before any new request.

This module imports nothing heavy at import time; the engines import aiohttp.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Coroutine, Sequence
from typing import Any

import torch

from glmlight.engines import transport as wt
from glmlight.errors import EngineError
from glmlight.models.mtp import PREFIX as MTP_PREFIX, to_checkpoint_names
from glmlight.engines.base import Generation, NamedTensors, SamplingParams, normalize_requests
from glmlight.engines.servers.launch import LaunchSpec, ManagedServer
from glmlight.engines.servers.server_checks import weights_fingerprint
from glmlight.engines.servers.server_replay import ReplayCapture
from glmlight.engines.servers.server_suspects import SuspectTracking
from glmlight.engines.servers.server_update import FleetUpdate
from glmlight.engines.servers.server_types import (Answer, FleetFailed, Source, UpdateFailed)

log = logging.getLogger(__name__)


class ServerEngineBase(ReplayCapture, SuspectTracking, FleetUpdate):
    """See the module docstring. Subclasses set `name` / `health_path` and implement the protocol
    hooks `_generate_one`, `_score_one`, `_pause`, `_flush`, `_resume`, `_push`, `_served_label`;
    replay records: `ReplayCapture` (server_replay.py); one fleet update: `FleetUpdate`
    (server_update.py)."""

    name = "server"
    health_path = "/health"
    sends_fp8_weights = True  # rollout.weight_format=fp8: pushes carry the block-FP8 checkpoint layout

    def __init__(self, urls: Sequence[str], *, router: bool = False, http: Any = None, launch: LaunchSpec | None = None,
                 ready_timeout_s: float = 900.0, version: int = 0, confirm_timeout_s: float | None = None,
                 poll_interval_s: float = 0.05, update_retries: int = 2, resync: bool = True,
                 verify_updates: bool = True, weight_format: str = "auto", launch_restarts: int = 0,
                 shm_dir: str = "/dev/shm"):
        from glmlight.engines.servers.http import HttpClient, HttpSettings, UrlPool

        self.weight_format = weight_format  # auto | fp8 (glmlight.models.fp8_checkpoint.to_server_weights)
        self.shm_dir, self._slots = shm_dir, None  # weight_sync=shm: SharedMemorySlots, made at the first update
        self.last_sync_seconds: dict[str, float] = {}  # the last update's stages, seconds (what the engine measured)

        self.launcher: ManagedServer | None = None
        self.launch_restarts, self.num_server_restarts = launch_restarts, 0
        self.ready_timeout_s = ready_timeout_s
        self._closed = False
        self.http = HttpClient(self.name, http or HttpSettings(), on_connection_error=self._check_launcher,
                               on_server_error=self._on_server_error)
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
            self.update_retries, self.resync, self.verify_updates = update_retries, resync, verify_updates
            self.num_duplicates = 0
            self.num_resyncs = 0
            self.num_stale_answers = 0
            self._initial = Source(version, None)
            self._current: Source = self._initial  # what every server serves now
            self._expect: dict[str, str | None] = {}  # url -> the label it must report (None: initial)
            self._url_version: dict[str, int] = {u: version for u in self.urls}
            self._suspects: set[str] = set()
            self.pool.avoid = self._suspects
            # One fleet change at a time: an update (the trainer) and a re-sync (a generating thread)
            self._fleet_lock = threading.RLock()
            self._failed: str | None = None
            self._probe: tuple[list[int], list[int]] | None = None
            self._probe_scores: dict[str, list[float]] = {}
            self._fingerprint: torch.Tensor | None = None
            self._shapes: dict[str, tuple[int, ...]] | None = None  # name -> shape the servers serve
            for url in self.urls:
                self._wait_ready(url, ready_timeout_s)
            try:
                self._after_ready()
            except EngineError:
                self._raise_if_exited()  # a server that died on its first requests: say why, from its log
                raise
            for url in self.urls[1:] if router else self.urls:
                self._expect[url] = None
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ protocol
    @property
    def version(self) -> int:
        return self._version

    def generate(self, prompts: list[list[int]], params: SamplingParams | Sequence[SamplingParams]) -> list:
        self._check_usable()
        if not prompts:
            return []
        params = normalize_requests(prompts, params)
        self._remember_probe(prompts[0])
        self._restart_exited_server()
        self._check_unlabelled()
        self._sync_suspects()
        from glmlight.engines.servers.http import new_rid

        out: list[Generation | None] = [None] * len(prompts)
        pending = list(range(len(prompts)))
        for _ in range(3):
            jobs = [(rid, self._generate_one(rid, list(prompts[i]), params[i])) for rid, i in
                    zip((new_rid() for _ in pending), pending)]
            answers: list[Answer] = self.http.run(self._gather_by_rid(jobs))
            stale = []
            for i, a in zip(pending, answers):
                if self._is_stale(a):
                    stale.append(i)
                else:
                    a.gen.versions = self._versions_of(a)
                    out[i] = a.gen
            if not stale:
                return out
            self.num_stale_answers += len(stale)
            log.warning("%s: %d answers came from weights other than version %d; re-syncing and asking again",
                        self.name, len(stale), self._version)
            self._sync_suspects()
            pending = stale
        raise EngineError(f"{self.name}: servers kept answering with weights other than version {self._version} "
                          f"(servers {sorted(self._suspects)})")

    def score(self, prompts: list[list[int]], completions: list[list[int]]) -> list[list[float]]:
        self._check_usable()
        if len(prompts) != len(completions):
            raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
        for i, p in enumerate(prompts):
            if not p:
                raise ValueError(f"prompt {i} is empty")
        self._restart_exited_server()
        self._sync_suspects()
        from glmlight.engines.servers.http import new_rid

        jobs = [(rid, self._score_one(rid, list(p), list(c)))
                for rid, p, c in zip((new_rid() for _ in prompts), prompts, completions)]
        return self.http.run(self._gather_by_rid(jobs))

    def update_weights(self, named_tensors: NamedTensors | None = None, *, path: str | None = None, version: int) -> None:
        """Move every server to `version` together (module docstring); only then does
        `self.version` change. Raises a one-line EngineError when it cannot."""
        self._check_usable()
        if (named_tensors is None) == (path is None):
            raise ValueError("update_weights needs exactly one of named_tensors or path")
        self.last_sync_seconds = {}
        named = list(named_tensors) if named_tensors is not None else None
        if named is not None and any(n.startswith(MTP_PREFIX) for n, _ in named):
            named = list(to_checkpoint_names(named))  # MTP layers as the server's checkpoint names them
        if named is not None:
            self._check_shapes(named, version)
        fingerprint = weights_fingerprint(named) if named is not None else None
        if named is not None and self.weight_format != "auto":
            from glmlight.models.fp8_checkpoint import to_server_weights

            named = list(to_server_weights(named, self.weight_format, getattr(self, "model_path", None)))
        urls = self._sync_urls()
        error: Exception | None = None
        with self._fleet_lock:
            for attempt in range(self.update_retries + 1):
                try:
                    self._restart_exited_server()
                    source = self._update_fleet(urls, named, path, version, fingerprint)
                    break
                except UpdateFailed as e:
                    error = e
                    log.warning("%s: weight update to version %d failed (attempt %d of %d), every server still "
                                "serves version %d: %s", self.name, version, attempt + 1, self.update_retries + 1,
                                self._version, e)
            else:
                raise EngineError(f"{self.name}: weight update to version {version} failed {self.update_retries + 1}"
                                  f" times; every server still serves version {self._version} (last error: {error})")
            self._current = source
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
            if self._slots is not None:
                self._slots.close()
            self.http.close()
            if self.launcher is not None:
                self.launcher.stop()

    # ------------------------------------------------------------------ helpers
    def _check_usable(self) -> None:
        if self._closed:
            raise EngineError(f"the {self.name} engine is closed")
        if self._failed is not None:
            raise FleetFailed(self._failed)

    def _sync_urls(self) -> list[str]:
        """The servers that receive weight updates: every URL, or in router mode the
        worker URLs listed after the router's."""
        if not self.router:
            return list(self.urls)
        if len(self.urls) < 2:
            raise EngineError(f"{self.name} router mode: weight sync needs the worker URLs after the router URL in "
                              "rollout.server.urls (the router only routes generation)")
        return list(self.urls[1:])

    control_urls = _sync_urls

    def _remember_probe(self, prompt: list[int]) -> None:
        if self._probe is None and len(prompt) >= 4:
            cut = max(1, len(prompt) // 2)
            self._probe = (list(prompt[:cut]), list(prompt[cut:]))

    def _check_launcher(self) -> None:
        if self.launcher is not None:
            self.launcher.check()

    def _raise_if_exited(self, wait_s: float = 15.0) -> None:
        """After a failed request to a managed server: if its process exits within `wait_s` (a worker that
        died takes the server down a moment after the error), raise its exit as one line with the log's
        last lines (`ManagedServer.check`) instead of the client-side symptom (a refused connection, a 500)."""
        if self.launcher is None:
            return
        deadline = time.monotonic() + wait_s
        while self.launcher.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        self.launcher.check()

    def _restart_exited_server(self) -> None:
        """A managed server that exited (killed, crashed) is started again on the same address, up to
        `launch_restarts` times, and waited for; it then serves its start-up weights, so it is a
        suspect: `_sync_suspects` gives it the current ones before any request. Past the limit, the
        exit is raised as one line (`ManagedServer.check`). Called from the caller's thread, before
        generating, scoring or updating (never from the HTTP loop: the wait blocks)."""
        if self.launcher is None or self.launcher.proc.poll() is None or self._closed:
            return
        with self._fleet_lock:
            if self.launcher.proc.poll() is None:
                return
            try:
                self.launcher.check()
            except EngineError as e:
                if self.num_server_restarts >= self.launch_restarts:
                    self._failed = f"{e} (restarted {self.num_server_restarts} times already)"
                    raise FleetFailed(self._failed) from None
                log.warning("%s; starting it again (restart %d of %d)", e, self.num_server_restarts + 1,
                            self.launch_restarts)
            spec, url = self.launcher.spec, self.launcher.spec.url
            self.launcher.stop()  # whatever is left of its process group
            self.launcher = spec.start()
            self.num_server_restarts += 1
            self._wait_ready(url, self.ready_timeout_s)
            self._suspects.add(url)

    def _wait_ready(self, url: str, timeout_s: float) -> None:
        from glmlight.engines.servers.http import ServerUnavailable

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

    def _write_shm(self, named: list, config_dir: str | None) -> str:
        """weight_sync=shm: write `named` into the shared-memory slot the servers do not serve from; its
        directory (the served one stays whole for a rollback)."""
        if self._slots is None:
            self._slots = wt.SharedMemorySlots(self.shm_dir, config_dir)
        t = time.perf_counter()
        path = self._slots.write(named, self._current.path)
        self.last_sync_seconds["write"] = time.perf_counter() - t
        return path

    def _before_close(self) -> None:
        """Hook: release protocol state (e.g. a weight-update process group)."""

    def _destroy_group(self) -> None:
        """Leave the weight-update process group (`self._group`, the distributed sync mode's), if joined."""
        if getattr(self, "_group", None) is not None:
            try:
                torch.distributed.destroy_process_group(self._group)
            except Exception:  # noqa: BLE001 - closing must not fail
                pass
            self._group = None

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
            raise next((e for e in errors if getattr(e, "fatal", False)),
                       next((e for e in errors if isinstance(e, EngineError)), errors[0]))
        missing = [rid for rid, _ in jobs if rid not in results]
        if missing:
            raise EngineError(f"{self.name}: {len(missing)} of {len(jobs)} requests got no answer")
        return [results[rid] for rid, _ in jobs]

    # ------------------------------------------------------------------ hooks to implement
    async def _generate_one(self, rid: str, prompt: list[int], params: SamplingParams) -> Answer:
        raise NotImplementedError

    async def _score_one(self, rid: str, prompt: list[int], completion: list[int], url: str | None = None) -> list[float]:
        raise NotImplementedError

    async def _pause(self, url: str) -> None:
        raise NotImplementedError

    async def _flush(self, url: str) -> None:
        raise NotImplementedError

    async def _resume(self, url: str) -> None:
        raise NotImplementedError

    def _push(self, urls: Sequence[str], named: list | None, path: str | None, version: int) -> Source:
        """Give every server in `urls` the new weights, or raise UpdateFailed with every server back
        on `self._previous()` (FleetFailed if that is impossible). Returns the new version's Source."""
        raise NotImplementedError

    async def _served_label(self, url: str) -> str | None:
        raise NotImplementedError
