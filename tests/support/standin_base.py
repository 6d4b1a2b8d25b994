"""The base of the loopback server stand-ins (tests/support/standin_sglang.py, tests/support/standin_vllm.py): an
aiohttp app in its own thread on 127.0.0.1, backed by the embedded `LocalEngine`, that records every
request (path, JSON body, headers) and injects faults on chosen calls — HTTP errors, slow answers,
dropped connections (before the server did the work, or after: "drop_after"), malformed bodies, a restart (stop, then start again on the same port; with
`fresh`, like a real restart: the initial weights and version), and, with `after`, only from the
k-th matching call on."""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import datetime
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from aiohttp import web

from glmlight.engines.base import SamplingParams
from glmlight.engines.local.engine import LocalEngine

FAULT = web.RequestKey("fault", object)  # the fault injected into this request (handlers may act on it)

@dataclass
class Recorded:
    path: str
    body: Any
    headers: dict[str, str]
    fault: str | None = None  # the fault injected into this call, if any
    time: float = field(default_factory=time.monotonic)


@dataclass
class Fault:
    path: str
    kind: str  # status | delay | drop | malform | restart | a kind a subclass handles (e.g. lie)
    times: int = 1
    status: int = 500
    seconds: float = 0.0
    mutate: Callable[[Any], Any] | None = None
    after: int = 0  # let this many matching calls through first
    body: Any = None  # the JSON body of a status fault (default: an error envelope)
    when: Callable[[Any], bool] | None = None  # only calls whose JSON body this accepts


def join_gloo_group(address: str, port: int, world_size: int, rank: int, group_name: str, timeout_s: float = 30.0):
    """Join, as `rank`, a group the trainer built with `init_custom_process_group(gloo)`: the
    same TCP rendezvous and torch's store prefixes (group_name, then group_name + "/", then
    the device "cpu/"). A raw ProcessGroupGloo, because the trainer's side registered that
    group name in this very process."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(address, port, world_size, is_master=False, timeout=timeout)
    store = dist.PrefixStore("cpu/", dist.PrefixStore(f"{group_name}/", dist.PrefixStore(group_name, store)))
    return dist.ProcessGroupGloo(store, rank, world_size, timeout)


def receive(group: Any, names: list, dtypes: list, shapes: list) -> list:
    out = []
    for name, dtype, shape in zip(names, dtypes, shapes):
        t = torch.empty(shape, dtype=getattr(torch, dtype))
        group.broadcast(t, 0).wait()
        out.append((name, t))
    return out


class ProtocolServer:
    """Base: an aiohttp app in its own thread with auth, recording and fault injection."""

    def __init__(self, engine: LocalEngine, *, api_key: str | None = None, port: int = 0):
        self.engine, self.api_key, self.host, self.port = engine, api_key, "127.0.0.1", port
        self.requests: list[Recorded] = []
        # request id -> every Generation computed for it; a retried request may
        # have been computed twice (the first attempt's answer never reached the client)
        self.answers: dict[str, list] = collections.defaultdict(list)
        self.scores: dict[str, list] = collections.defaultdict(list)  # the same for prefill log-probs
        self.faults: list[Fault] = []
        self.restarts = 0
        self._lock = threading.Lock()
        self._stop_lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(8)
        self._ctl_pool = concurrent.futures.ThreadPoolExecutor(2)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._runner: web.AppRunner | None = None
        self.initial = {k: v.detach().clone() for k, v in engine.model.state_dict().items()}

    # ------------------------------------------------------------------ lifecycle
    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> ProtocolServer:
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)
        return self

    async def _start(self) -> None:
        app = web.Application(middlewares=[self._middleware], client_max_size=1 << 30)
        self.routes(app)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port, reuse_address=True)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    def stop(self) -> None:
        with self._stop_lock:
            if self._runner is not None:
                asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
                self._runner = None

    def restart(self, down_s: float = 0.0, fresh: bool = False) -> None:
        """Stop, wait, start on the same port; `fresh`: come back as a new process would, with the
        weights and version it was started with."""
        self.stop()
        if fresh:
            self.reset_state()
        time.sleep(down_s)
        self.start()
        self.restarts += 1

    def reset_state(self) -> None:
        """Back to the weights (and version label) the server was started with."""
        with torch.no_grad():
            self.engine.update_weights(list(self.initial.items()), version=0)

    def close(self) -> None:
        """Stop serving and close the backing engine (the server owns it)."""
        self.stop()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._ctl_pool.shutdown(wait=False, cancel_futures=True)
        self.engine.close()

    # ------------------------------------------------------------------ faults and records
    def inject(self, path: str, kind: str, **kw: Any) -> None:
        with self._lock:
            self.faults.append(Fault(path, kind, **kw))

    def calls(self, path: str | None = None) -> list[Recorded]:
        with self._lock:
            return [r for r in self.requests if path is None or r.path == path]

    def paths(self) -> list[str]:
        return [r.path for r in self.calls()]

    def _take_fault(self, path: str, body: Any = None) -> Fault | None:
        with self._lock:
            for f in self.faults:
                if f.path == path and f.times > 0 and (f.when is None or f.when(body)):
                    if f.after > 0:
                        f.after -= 1
                        continue
                    f.times -= 1
                    return f
        return None

    @web.middleware
    async def _middleware(self, request: web.Request, handler: Any) -> web.StreamResponse:
        raw = await request.read()
        try:
            body = await request.json() if raw else None
        except ValueError:
            body = raw.decode("utf-8", "replace")
        record = Recorded(request.path, body, dict(request.headers))
        with self._lock:
            self.requests.append(record)
        needs_key = self.api_key is not None and request.path not in self.open_paths
        if needs_key and request.headers.get("Authorization") != f"Bearer {self.api_key}":
            return web.json_response({"error": "Unauthorized"}, status=401)
        fault = self._take_fault(request.path, body)
        record.fault = fault.kind if fault is not None else None
        if fault is not None and fault.kind == "status":
            return web.json_response(fault.body if fault.body is not None else
                                     {"error": {"message": "injected failure", "type": "InternalServerError",
                                                "param": None, "code": fault.status}}, status=fault.status)
        if fault is not None and fault.kind == "html":  # a proxy's page, answered with 200
            return web.Response(text="<html><body>Bad gateway</body></html>", content_type="text/html")
        if fault is not None and fault.kind == "empty":
            return web.Response(status=200)
        if fault is not None and fault.kind == "delay":
            await asyncio.sleep(fault.seconds)
        if fault is not None and fault.kind in ("drop", "restart", "restart_fresh"):
            if fault.kind != "drop":
                threading.Thread(target=self.restart, args=(fault.seconds, fault.kind == "restart_fresh"),
                                 daemon=True).start()
            request.transport.close()  # type: ignore[union-attr]
            return web.Response(status=500)
        request[FAULT] = fault
        response = await handler(request)
        if fault is not None and fault.kind == "drop_after":  # the server did the work; the answer is lost
            request.transport.close()  # type: ignore[union-attr]
            return web.Response(status=500)
        if fault is not None and fault.kind == "malform" and fault.mutate is not None:
            return web.json_response(fault.mutate(_json_of(response)))
        return response

    async def run_engine(self, fn: Callable[..., Any], *args: Any, control: bool = False) -> Any:
        pool = self._ctl_pool if control else self._pool
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)

    # ------------------------------------------------------------------ to implement
    open_paths: tuple[str, ...] = ()

    def routes(self, app: web.Application) -> None:
        raise NotImplementedError


def _json_of(response: web.StreamResponse) -> Any:
    import json

    return json.loads(response.body)  # type: ignore[attr-defined]


def _params(sp: dict, max_new: int) -> SamplingParams:
    top_k = int(sp.get("top_k", -1))
    return SamplingParams(temperature=float(sp.get("temperature", 1.0)), top_p=float(sp.get("top_p", 1.0)),
                          top_k=max(0, top_k), max_new_tokens=max_new,
                          stop_token_ids=list(sp.get("stop_token_ids") or []), seed=sp.get("seed", sp.get("sampling_seed")))
