"""Per-answer weight versions and suspects of a server fleet (a mixin of `ServerEngineBase`,
glmlight/engines/servers/base.py): an answer labelled with other weights than its server must serve
is stale; a server that dropped a connection or answered stale is a suspect, probed before the
next call and, if it restarted on other weights, re-synced to the current ones."""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any, Callable

from glmlight.errors import EngineError
from glmlight.engines.servers.server_types import Answer, FleetFailed, UpdateFailed

log = logging.getLogger("glmlight.engines.servers.base")


class SuspectTracking:
    """Part of `ServerEngineBase`, which sets the state and defines the calls declared here."""

    name: str
    health_path: str
    http: Any
    _version: int
    _current: Any
    _expect: dict[str, str | None]
    _url_version: dict[str, int]
    _suspects: set[str]
    _fleet_lock: threading.RLock
    _served_label: Callable[..., Any]
    _update_fleet: Callable[..., Any]

    def _is_stale(self, a: Answer) -> bool:
        want = self._expect.get(a.url)
        if want is None or not a.labels:
            return False
        if all(label == want for label in a.labels):
            return False
        self._suspects.add(a.url)
        return True

    def _versions_of(self, a: Answer) -> list[int]:
        v = self._url_version.get(a.url, self._version)
        return [v] * len(a.gen.token_ids)

    def _labels_answers(self, url: str) -> bool:
        """Whether this server reports the weight version of each answer (else `_check_unlabelled`
        asks it for its version before every call)."""
        return True

    def _check_unlabelled(self) -> None:
        urls = [u for u, want in self._expect.items() if want is not None and not self._labels_answers(u)]
        if not urls:
            return

        async def labels() -> list:
            return await asyncio.gather(*(self._served_label(u) for u in urls), return_exceptions=True)

        for url, served in zip(urls, self.http.run(labels())):
            if isinstance(served, BaseException) or served != self._expect[url]:
                self._suspects.add(url)

    def _on_server_error(self, url: str, connection_lost: bool) -> None:
        if connection_lost and url in self._expect:
            self._suspects.add(url)

    def _sync_suspects(self) -> None:
        """Probe every suspect; one that restarted (serves other weights) gets the current ones."""
        if not self._suspects:
            return
        with self._fleet_lock:
            self._sync_suspects_locked()

    def _sync_suspects_locked(self) -> None:
        for url in sorted(self._suspects):
            try:
                self.http.run(self._probe_alive(url))
                served = self.http.run(self._served_label(url))
            except EngineError:
                continue  # still down: requests go elsewhere (or fail and are counted)
            want = self._expect.get(url)
            if want is None or served == want:
                self._suspects.discard(url)
                continue
            log.warning("%s server at %s serves weight version %r, expected %r (it restarted?): re-syncing it",
                        self.name, url, served, want)
            self._resync(url)

    async def _probe_alive(self, url: str) -> None:
        """Raise EngineError unless the server at `url` is up. Default: its health path, 10 s. A
        server whose health check generates (SGLang's /health_generate, and /health with
        SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION on, its default) answers it 503 after 20 s while
        it is paused: such an engine probes with a call that the pause does not hold instead."""
        await self.http.request(self.health_path, url=url, method="GET", expect_json=False, attempts=1, timeout_s=10)

    def _resync(self, url: str) -> None:
        src = self._current
        if src.named is None and src.path is None:
            self._failed = (f"{self.name} server at {url} lost the weights of version {src.version} (it serves "
                            f"other weights) and rollout.server.resync is off, so they cannot be sent again")
            raise FleetFailed(self._failed)
        urls = self._resync_urls(url)
        try:
            self._update_fleet(urls, src.named, src.path, src.version, None)
        except UpdateFailed as e:
            log.warning("%s: re-sync of %s failed (%s); it stays out of rotation", self.name, url, e)
            return
        self.num_resyncs += 1

    def _resync_urls(self, url: str) -> list[str]:
        """The servers a re-sync of `url` must push to (a subclass may need the whole fleet)."""
        return [url]
