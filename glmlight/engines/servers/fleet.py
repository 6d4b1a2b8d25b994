"""`ServerFleet`: the RolloutEngine protocol over a fleet of inference servers of one backend. It owns the
URLs and routing, the readiness wait, the rid-keyed gather (every prompt's answer comes back exactly
once, in order), the all-or-nothing weight update of the whole fleet, per-answer weight versions, the
servers marked out and their re-sync, and a managed server's restart; it drives one `ServerAdapter` per
server (protocol.py; vLLM's vllm/adapter.py, SGLang's sglang/adapter.py) and the backend's `WeightSync`.

Parts it holds, each given to its constructor: the HTTP client (http.py), the adapters, the weight-sync
transport, the replay records asked for (`ReplayCapture`, replay.py), the per-server bookkeeping
(`Suspects`, suspects.py), the post-update probe and the served shapes (checks.py), and a managed
server (launch.py). `VLLMEngine` (vllm/engine.py) and `SGLangEngine` (sglang/engine.py) build these parts
from their settings.

A weight update (`update_weights`):

    pause every server → push (the transport: all servers get the new weights, or every server is put
    back on the previous ones and `UpdateFailed` is raised) → flush caches → confirm every server
    reports the new version → resume → verify (a probe scored on every server: a server that
    acknowledged the version but still answers exactly as before did not load it)

A policy's MTP layers (`mtp.layers.{k}.*`) are sent under the names a checkpoint gives them,
`model.layers.{num_hidden_layers + k}.*` (glmlight.models.mtp), which the main-model loaders of SGLang 0.5.23 and
vLLM 0.32 skip for a checkpoint that declares them (config.json's num_nextn_predict_layers; read in their
sources, not run here); loading them into a speculating server's MTP draft is not built yet.

`UpdateFailed` is retried (`update_retries`); then the run stops with one line. `FleetFailed`
(servers left on different or unknown weights) stops it at once. Each server's answers carry the
version it reports for them (SGLang meta_info.weight_version(s), vLLM 0.33 weight_versions; vLLM
0.32: the version the server acknowledged last); an answer with another version than the one its
server must serve is never returned: the server is re-synced and the prompt asked again.

A server that drops or refuses connections, or answers with another version, is marked out (a
suspect): before the next call it is probed, and if it serves other weights than the current version
(it restarted) it gets the current weights again (`resync`) before any new request.

In router mode (`router`), the first URL is the router, which generation goes through; the URLs after it
are its workers, which take the weight updates.

A managed fleet (`launch`: one LaunchSpec per server, `rollout.server.num_servers`) starts every server, and
with `router_launch` the backend's own router in front of them (router.py); all of them are stopped on every
exit path. A managed server that dies is marked out at once (and taken out of the router's rotation through
its worker API), so requests go to the others; before the next call it is started again, re-synced to the
current version, and only then marked in (and given back to the router). A router that dies is started
again on its port with the same workers.

This module imports nothing heavy at import time; the engines import aiohttp.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

import torch

from glmlight.errors import EngineError
from glmlight.models.mtp import PREFIX as MTP_PREFIX, to_checkpoint_names
from glmlight.engines.base import Generation, NamedTensors, SamplingParams, normalize_requests
from glmlight.engines.servers.checks import ServedShapes, UpdateProbe, check_replay_records, weights_fingerprint
from glmlight.engines.servers.launch import LaunchSpec, ManagedServer
from glmlight.engines.servers.protocol import Answer, FleetFailed, ServerAdapter, Source, UpdateFailed, WeightSync
from glmlight.engines.servers.replay import ReplayCapture
from glmlight.engines.servers.router import RouterAdmin
from glmlight.engines.servers.suspects import Suspects

log = logging.getLogger(__name__)


def fleet_urls(urls: Sequence[str], launch: Sequence[LaunchSpec], router_launch: LaunchSpec | None) -> list[str]:
    """The URLs a fleet's adapters talk to: a managed fleet's (its router first), else the servers in `urls`."""
    if not launch:
        return list(urls)
    return ([router_launch.url] if router_launch is not None else []) + [spec.url for spec in launch]


class ServerFleet:
    """See the module docstring. `servers`: one adapter per URL, in `urls` order (a managed launch's:
    its own URL); `on_ready(fleet)`: what the backend checks once every server answers."""

    name = "server"
    filter_order = "sequential"  # how the servers combine top-k and top-p (glmlight/ops/logprobs.py)
    sends_fp8_weights = True  # rollout.weight_format=fp8: pushes carry the block-FP8 checkpoint layout

    def __init__(self, servers: Sequence[ServerAdapter], *, http: Any, sync: WeightSync, replay: ReplayCapture,
                 router: bool = False, launch: Sequence[LaunchSpec] = (), router_launch: LaunchSpec | None = None,
                 ready_timeout_s: float = 900.0,
                 version: int = 0, confirm_timeout_s: float | None = None, poll_interval_s: float = 0.05,
                 update_retries: int = 2, resync: bool = True, verify_updates: bool = True,
                 weight_format: str = "auto", launch_restarts: int = 0, model_path: str | None = None,
                 on_ready: Callable[[ServerFleet], None] | None = None, owns_fleet: bool = True):
        from glmlight.engines.servers.http import UrlPool

        self.http, self.sync, self.replay = http, sync, replay
        # False: a client of a fleet another data-parallel rank owns (it pushes the weights and re-syncs servers;
        # this rank adopts each version it pushed, `adopt_version`)
        self.owns_fleet = owns_fleet
        self.servers: dict[str, ServerAdapter] = {s.url: s for s in servers}
        self.urls = [s.url for s in servers]
        self.router = router
        self.weight_format = weight_format  # auto | fp8 (glmlight.models.fp8_checkpoint.to_server_weights)
        self.model_path = model_path
        self.launchers: dict[str, ManagedServer] = {}  # url -> a managed server's process
        self.router_proc: ManagedServer | None = None
        self.router_admin = RouterAdmin(router_launch.name, router_launch.url) if router_launch is not None else None
        self._out_of_router: set[str] = set()  # workers taken out of the router's rotation
        self.launch_restarts, self.num_server_restarts = launch_restarts, 0
        self.ready_timeout_s = ready_timeout_s
        self.confirm_timeout_s = confirm_timeout_s or http.settings.timeout_s
        self.poll_interval_s = poll_interval_s
        self.update_retries, self.resync, self.verify_updates = update_retries, resync, verify_updates
        self.num_duplicates = self.num_resyncs = self.num_stale_answers = self.num_router_removals = 0
        self._closed = False
        self._version = version
        self._current = Source(version, None)  # what every server serves now
        # the servers whose versions are tracked: the workers (in router mode an answer's URL is the router's, and
        # its version the fleet's, since every worker takes each update together)
        self.suspects = Suspects(self.urls[1:] if router else self.urls, version, on_out=self._leave_router,
                                 on_in=self._rejoin_router)
        self.probe = UpdateProbe()
        self.shapes = ServedShapes(model_path)
        # One fleet change at a time: an update (the trainer) and a re-sync (a generating thread)
        self._fleet_lock = threading.RLock()
        self._failed: str | None = None
        http.on_connection_error = self._check_launcher
        http.on_server_error = self.suspects.on_server_error
        try:
            for spec in launch:
                self.launchers[spec.url] = spec.start()
            if router_launch is not None:
                self.router_proc = router_launch.start()
            self.pool = UrlPool(self.urls[:1] if router else self.urls)
            self.pool.avoid = self.suspects.out
            for url in self.urls[1:] + self.urls[:1] if router_launch is not None else self.urls:
                self._wait_ready(self.servers[url], ready_timeout_s)
            self._wait_router_workers(ready_timeout_s)
            try:
                if on_ready is not None:
                    on_ready(self)
            except EngineError:
                self._raise_if_exited()  # a server that died on its first requests: say why, from its log
                raise
            for url in self.urls[1:] if router else self.urls:
                self.suspects.watch(url)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ protocol
    @property
    def version(self) -> int:
        return self._version

    @property
    def launcher(self) -> ManagedServer | None:
        """The managed server's process, for a fleet of one (the first server of a larger one)."""
        return next(iter(self.launchers.values()), None)

    @property
    def front(self) -> ServerAdapter:
        """The adapter that formats generation and scoring requests; the pool (`route`) picks the server
        of each attempt. Every adapter of a fleet formats alike."""
        return self.servers[self.pool.urls[0]]

    def generate(self, prompts: list[list[int]], params: SamplingParams | Sequence[SamplingParams]) -> list:
        self._check_usable()
        if not prompts:
            return []
        params = normalize_requests(prompts, params)
        self.probe.remember(prompts[0])
        self._restart_exited_server()
        self._check_unlabelled()
        self.sync_suspects()
        from glmlight.engines.servers.http import new_rid

        out: list[Generation | None] = [None] * len(prompts)
        pending = list(range(len(prompts)))
        for _ in range(3):
            jobs = [(rid, self.front.generate(rid, list(prompts[i]), params[i], self.pool)) for rid, i in
                    zip((new_rid() for _ in pending), pending)]
            answers: list[Answer] = self.http.run(self._gather_by_rid(jobs))
            stale = []
            for i, a in zip(pending, answers):
                if self.suspects.is_stale(a):
                    stale.append(i)
                else:
                    a.gen.versions = self.suspects.versions_of(a, self._version)
                    out[i] = a.gen
            if not stale:
                return out
            self.num_stale_answers += len(stale)
            log.warning("%s: %d answers came from weights other than version %d; re-syncing and asking again",
                        self.name, len(stale), self._version)
            self.sync_suspects()
            pending = stale
        raise EngineError(f"{self.name}: servers kept answering with weights other than version {self._version} "
                          f"(servers {list(self.suspects)})")

    def score(self, prompts: list[list[int]], completions: list[list[int]]) -> list[list[float]]:
        self._check_usable()
        if len(prompts) != len(completions):
            raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
        for i, p in enumerate(prompts):
            if not p:
                raise ValueError(f"prompt {i} is empty")
        self._restart_exited_server()
        self.sync_suspects()
        from glmlight.engines.servers.http import new_rid

        jobs = [(rid, self.front.score(rid, list(p), list(c), self.pool))
                for rid, p, c in zip((new_rid() for _ in prompts), prompts, completions)]
        return self.http.run(self._gather_by_rid(jobs))

    def update_weights(self, named_tensors: NamedTensors | None = None, *, path: str | None = None, version: int) -> None:
        """Move every server to `version` together (module docstring); only then does
        `self.version` change. Raises a one-line EngineError when it cannot."""
        self.sync.check(self._sync_servers())
        self._check_usable()
        if (named_tensors is None) == (path is None):
            raise ValueError("update_weights needs exactly one of named_tensors or path")
        named = list(named_tensors) if named_tensors is not None else None
        if named is not None and any(n.startswith(MTP_PREFIX) for n, _ in named):
            named = list(to_checkpoint_names(named))  # MTP layers as the server's checkpoint names them
        if named is not None:
            self.shapes.check(named, self.name, version, self._version)
        fingerprint = weights_fingerprint(named) if named is not None else None
        if named is not None and self.weight_format != "auto":
            from glmlight.models.fp8_checkpoint import to_server_weights

            named = list(to_server_weights(named, self.weight_format, self.model_path))
        servers = self._sync_servers()
        error: Exception | None = None
        with self._fleet_lock:
            for attempt in range(self.update_retries + 1):
                try:
                    self._restart_exited_server()
                    source = self._update_fleet(servers, named, path, version, fingerprint)
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

    def adopt_version(self, version: int) -> None:
        """The fleet's owner (another data-parallel rank) moved every server to `version`: answers from now on
        carry it (the SharedFleet protocol, glmlight/engines/base.py)."""
        self._version = version
        self.suspects.served([s.url for s in self._sync_servers()], version)
        self._current = Source(version, None)

    # ------------------------------------------------------------------ replay records (replay.py)
    def capture_replay(self, routing: bool = False, index: bool = False) -> None:
        """Return the replay records asked for with every generation from now on (`ReplayCapture.start`),
        after a probe generation on every server shows that each can."""
        servers = [self.servers[u] for u in self.pool.urls]
        self.replay.start(routing, index, lambda: check_replay_records(servers, self.http, self.name,
                                                                       self.replay.asked))

    @property
    def record_layout(self) -> Any:
        """Where the model's MoE and DSA layers sit in the servers' records (set by `build_server_engine`)."""
        return self.replay.layout

    @record_layout.setter
    def record_layout(self, layout: Any) -> None:
        self.replay.layout = layout

    @property
    def replay_capture(self) -> tuple[bool, bool]:
        return self.replay.asked

    @property
    def num_missing_records(self) -> int:
        return self.replay.num_missing

    # ------------------------------------------------------------------ what the transport measured
    @property
    def last_sync_seconds(self) -> dict[str, float]:
        """The last update's stages, seconds (what the engine and the servers measured)."""
        return self.sync.last_seconds

    @property
    def last_sync_bytes(self) -> dict[str, int]:
        """The last update's bytes sent and whole (delta sync)."""
        return self.sync.last_bytes

    def __enter__(self) -> "ServerFleet":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        from glmlight.engines.servers.settings import FLEET_ENV

        if self.launchers and self.urls[-1] in os.environ.get(FLEET_ENV, ""):
            del os.environ[FLEET_ENV]  # this fleet is gone: no rank started later may join it
        try:
            try:
                servers = self._sync_servers()
            except EngineError:
                servers = []
            self.sync.close(servers)
        finally:
            self.http.close()
            for proc in [self.router_proc, *self.launchers.values()]:
                if proc is not None:
                    proc.stop()

    # ------------------------------------------------------------------ the fleet update
    def _update_fleet(self, servers: Sequence[ServerAdapter], named: list | None, path: str | None, version: int,
                      fingerprint: torch.Tensor | None) -> Source:
        urls = [s.url for s in servers]
        try:
            self._run_all(lambda s: s.pause(), servers)
        except EngineError as e:
            self._resume_all(servers)
            raise UpdateFailed(f"could not pause every server: {e}") from None
        try:
            try:
                source = self.sync.push(servers, named, path, version, self._current)
            except (UpdateFailed, FleetFailed):
                raise
            except EngineError as e:  # the fleet's state is not known any more
                self._failed = f"{self.name}: a weight update to version {version} failed half-way: {e}"
                raise FleetFailed(self._failed) from None
            self.suspects.served(urls, version)
            try:
                self._run_all(lambda s: s.flush(), servers)
                self._confirm_version(servers, version)
            except FleetFailed:
                raise
            except EngineError as e:  # the new weights are in, but not flushed or not acknowledged
                self._failed = f"{self.name}: servers loaded weight version {version} but then failed: {e}"
                raise FleetFailed(self._failed) from None
        finally:
            self._resume_all(servers)
        if source.named is None and source.path is None and self.resync and named is not None:
            source.named = [(n, t.detach().to("cpu", copy=True)) for n, t in named]  # re-syncs and reverts
        if self.verify_updates:
            failure = self.probe.verify(servers, self.http, self.name, version, fingerprint)
            if failure is not None:
                self._failed = failure
                raise FleetFailed(failure)
        for u in urls:
            self.suspects.mark_in(u)
        return source

    def _resume_all(self, servers: Sequence[ServerAdapter]) -> None:
        try:
            self._run_all(lambda s: s.resume(), servers)
        except Exception as e:  # noqa: BLE001 - keep the original error, if any
            log.warning("%s: could not resume generation: %s", self.name, e)

    def _run_all(self, call: Callable[[ServerAdapter], Coroutine[Any, Any, Any]],
                 servers: Sequence[ServerAdapter]) -> None:
        async def all_() -> None:
            await asyncio.gather(*(call(s) for s in servers))

        self.http.run(all_())

    def _confirm_version(self, servers: Sequence[ServerAdapter], version: int) -> None:
        deadline = time.monotonic() + self.confirm_timeout_s
        for server in servers:
            while True:
                served = self.http.run(server.label())
                if served == str(version):
                    break
                if time.monotonic() > deadline:
                    self._failed = (f"{self.name} server at {server.url} still reports weight version {served!r} "
                                    f"{self.confirm_timeout_s:g}s after the update, expected {str(version)!r}")
                    raise FleetFailed(self._failed)
                time.sleep(self.poll_interval_s)

    # ------------------------------------------------------------------ servers marked out, re-syncs
    def sync_suspects(self) -> None:
        """Probe every server marked out; one that restarted (serves other weights) gets the current ones,
        and a server that serves what it must is marked back in."""
        if not self.suspects:
            return
        with self._fleet_lock:
            for url in list(self.suspects):
                server = self.servers[url]
                try:
                    self.http.run(server.alive())
                    served = self.http.run(server.label())
                except EngineError:
                    continue  # still down: requests go elsewhere (or fail and are counted)
                want = self.suspects.expect.get(url)
                if want is None or served == want:
                    self.suspects.mark_in(url)
                    continue
                log.warning("%s server at %s serves weight version %r, expected %r (it restarted?): re-syncing it",
                            self.name, url, served, want)
                self._resync(server)

    def _resync(self, server: ServerAdapter) -> None:
        if not self.owns_fleet:  # the owning rank re-syncs it; until then requests go to the other servers
            return
        src = self._current
        if src.named is None and src.path is None:
            self._failed = (f"{self.name} server at {server.url} lost the weights of version {src.version} (it "
                            f"serves other weights) and rollout.server.resync is off, so they cannot be sent again")
            raise FleetFailed(self._failed)
        targets = self.sync.resync_targets(server, self._sync_servers())
        try:
            self._update_fleet(targets, src.named, src.path, src.version, None)
        except UpdateFailed as e:
            log.warning("%s: re-sync of %s failed (%s); it stays out of rotation", self.name, server.url, e)
            return
        self.num_resyncs += 1

    def _check_unlabelled(self) -> None:
        """Ask every server whose answers carry no version for its version; one that serves other weights
        than it must is marked out."""
        urls = self.suspects.unlabelled(lambda u: self.servers[u].labels_answers())
        if not urls:
            return

        async def labels() -> list:
            return await asyncio.gather(*(self.servers[u].label() for u in urls), return_exceptions=True)

        for url, served in zip(urls, self.http.run(labels())):
            if isinstance(served, BaseException) or served != self.suspects.expect[url]:
                self.suspects.mark_out(url)

    # ------------------------------------------------------------------ helpers
    def _check_usable(self) -> None:
        if self._closed:
            raise EngineError(f"the {self.name} engine is closed")
        if self._failed is not None:
            raise FleetFailed(self._failed)

    def _sync_servers(self) -> list[ServerAdapter]:
        """The servers that receive weight updates: every server, or in router mode the workers listed
        after the router."""
        if not self.router:
            return [self.servers[u] for u in self.urls]
        if len(self.urls) < 2:
            raise EngineError(f"{self.name} router mode: weight sync needs the worker URLs after the router URL in "
                              "rollout.server.urls (the router only routes generation)")
        return [self.servers[u] for u in self.urls[1:]]

    def _check_launcher(self) -> None:
        """After a failed request (the HTTP loop's thread). A single managed server that exited: raise its exit
        as one line. In a fleet of several, or behind a managed router: mark every exited server out (the
        others take its requests) and leave the restart to the next call (`_restart_exited_server`)."""
        dead = [u for u, m in self.launchers.items() if m.proc.poll() is not None]
        if len(self.launchers) == 1 and self.router_proc is None:
            self.launcher.check()
            return
        for url in dead:
            self.suspects.mark_out(url)
        if dead and len(dead) == len(self.launchers) and self.launch_restarts == 0:
            self.launchers[dead[0]].check()

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
        `launch_restarts` times in all, and waited for; it then serves its start-up weights, so it is marked out:
        `sync_suspects` gives it the current ones before any request, and only then marks it in (and gives it
        back to the router). A managed router that exited is started again on its port. Past the limit, the
        exit is raised as one line (`ManagedServer.check`). Called from the caller's thread, before generating,
        scoring or updating (never from the HTTP loop: the wait blocks)."""
        if self._closed:
            return
        exited = [u for u, m in self.launchers.items() if m.proc.poll() is not None]
        router_exited = self.router_proc is not None and self.router_proc.proc.poll() is not None
        if not exited and not router_exited:
            return
        with self._fleet_lock:
            for url in exited:
                self.launchers[url] = self._start_again(self.launchers[url])
                self.suspects.mark_out(url)
                self._leave_router(url)
                self._wait_ready(self.servers[url], self.ready_timeout_s)
            if router_exited:
                self.router_proc = self._start_again(self.router_proc)
                self._wait_ready(self.servers[self.urls[0]], self.ready_timeout_s)
                self._out_of_router.clear()  # started with every worker: take the marked-out ones out again
                for url in self.suspects:
                    self._leave_router(url)
                self._wait_router_workers(self.ready_timeout_s)

    def _start_again(self, proc: ManagedServer) -> ManagedServer:
        """A managed process that exited, started again with the same command (counted against
        `launch_restarts`); its exit is raised as one line once the restarts are spent."""
        try:
            proc.check()
        except EngineError as e:
            if self.num_server_restarts >= self.launch_restarts:
                self._failed = f"{e} (restarted {self.num_server_restarts} times already)"
                raise FleetFailed(self._failed) from None
            log.warning("%s; starting it again (restart %d of %d)", e, self.num_server_restarts + 1,
                        self.launch_restarts)
        proc.stop()  # whatever is left of its process group
        self.num_server_restarts += 1
        return proc.spec.start()

    # ------------------------------------------------------------------ the managed router's rotation
    def _leave_router(self, url: str) -> None:
        """Take worker `url` out of the managed router's rotation (its worker API), once."""
        if self.router_admin is None or url in self._out_of_router or url not in self.launchers:
            return
        try:
            self.router_admin.remove(url)
            self._out_of_router.add(url)
            self.num_router_removals += 1
        except EngineError as e:  # a router that is down is restarted, and told again, before the next call
            log.warning("%s: cannot take %s out of the router's rotation: %s", self.name, url, e)

    def _rejoin_router(self, url: str) -> None:
        """Give worker `url`, serving the current version again, back to the managed router."""
        if self.router_admin is None or url not in self._out_of_router:
            return
        try:
            self.router_admin.add(url)
            self._out_of_router.discard(url)
        except EngineError as e:
            log.warning("%s: cannot give %s back to the router: %s", self.name, url, e)

    def _wait_router_workers(self, timeout_s: float) -> None:
        """Wait until the managed router routes to every worker in its rotation (sglang-router registers the
        workers of its command line in the background)."""
        if self.router_admin is None:
            return
        want = set(self.launchers) - self._out_of_router
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if want <= set(self.router_admin.workers()):
                    return
            except EngineError:
                pass
            if time.monotonic() > deadline:
                raise EngineError(f"{self.name}: the {self.router_admin.kind} at {self.router_admin.url} did not list "
                                  f"its workers {sorted(want)} within {timeout_s:g}s")
            time.sleep(0.2)

    def _wait_ready(self, server: ServerAdapter, timeout_s: float) -> None:
        from glmlight.engines.servers.http import ServerUnavailable

        url = server.url
        deadline, refusals = time.monotonic() + timeout_s, 0
        while True:
            self._check_launcher()
            try:
                self.http.run(self.http.request(server.health_path, url=url, method="GET", expect_json=False,
                                                attempts=1, timeout_s=min(30.0, timeout_s)))
                return
            except ServerUnavailable as e:
                refusals += e.refused
                # a fleet of one's own that refuses connections is not running; one that another rank owns may
                # still be starting (torchrun starts every rank at once): wait for it up to the timeout
                gave_up = refusals > self.http.settings.max_retries
                if e.refused and self.launcher is None and self.owns_fleet and gave_up:
                    raise EngineError(f"cannot reach {self.name} server at {url}: connection refused {refusals} times; "
                                      "is it running? (rollout.server.urls)") from None
                if time.monotonic() > deadline:
                    raise EngineError(f"{self.name} server at {url} did not become ready within {timeout_s:g}s "
                                      f"(last: {e})") from None
            time.sleep(min(max(self.http.settings.backoff_s, 0.01) * 2 ** min(refusals, 5), 0.5))

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
