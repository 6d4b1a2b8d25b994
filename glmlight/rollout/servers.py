"""What the SGLang and vLLM engines share: `ServerEngineBase` (URLs and routing, readiness
wait, request ids and the rid-keyed gather — every prompt's answer comes back exactly once, in
order —, the weight-sync skeleton pause → push → flush → resume → confirm version, close()),
the sampling fields both spell alike, and the constructor settings read from the config.

This module imports nothing heavy at import time; the engines import aiohttp.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine, Sequence
from typing import Any

from glmlight.errors import EngineError
from glmlight.rollout.base import NamedTensors, SamplingParams, normalize_requests
from glmlight.rollout.launch import LaunchSpec, ManagedServer

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
