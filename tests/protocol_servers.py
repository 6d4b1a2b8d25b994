"""Loopback stand-ins for SGLang and vLLM servers, backed by the embedded `LocalEngine`.

They speak the documented wire protocols (SGLang 0.5.x native API; vLLM's OpenAI-compatible
/v1/completions and its dev-mode endpoints, with glmlight's worker extension behind
/collective_rpc), so the real clients can be tested where no GPU server can run. They bind
to 127.0.0.1 on an ephemeral port, record every request (path, JSON body, headers) and
inject faults on chosen calls: HTTP errors, slow answers, dropped connections, malformed
bodies, and a restart (stop, then start again on the same port).

`python <script> --port P ...` calling `serve_main("sglang" | "vllm", argv)` runs one as a
stand-in executable for the managed-launch tests.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import collections
import concurrent.futures
import datetime
import signal
import threading
import time
import types
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.distributed as dist
from aiohttp import web

from glmlight.rollout.base import SamplingParams
from glmlight.rollout.local import LocalEngine
from glmlight.rollout.vllm_worker import WeightLoaderExtension


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
    kind: str  # status | delay | drop | malform | restart
    times: int = 1
    status: int = 500
    seconds: float = 0.0
    mutate: Callable[[Any], Any] | None = None


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
        self._pool = concurrent.futures.ThreadPoolExecutor(8)
        self._ctl_pool = concurrent.futures.ThreadPoolExecutor(2)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._runner: web.AppRunner | None = None

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
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
            self._runner = None

    def restart(self, down_s: float = 0.0) -> None:
        self.stop()
        time.sleep(down_s)
        self.start()
        self.restarts += 1

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

    def _take_fault(self, path: str) -> Fault | None:
        with self._lock:
            for f in self.faults:
                if f.path == path and f.times > 0:
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
        fault = self._take_fault(request.path)
        record.fault = fault.kind if fault is not None else None
        if fault is not None and fault.kind == "status":
            return web.json_response({"error": {"message": "injected failure"}}, status=fault.status)
        if fault is not None and fault.kind == "delay":
            await asyncio.sleep(fault.seconds)
        if fault is not None and fault.kind in ("drop", "restart"):
            if fault.kind == "restart":
                threading.Thread(target=self.restart, args=(fault.seconds,), daemon=True).start()
            request.transport.close()  # type: ignore[union-attr]
            return web.Response(status=500)
        response = await handler(request)
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


class SGLangServer(ProtocolServer):
    """SGLang's native API: /generate, weight updates, pause/continue, flush, model_info."""

    open_paths = ("/health", "/health_generate")  # SGLang's key middleware lets health checks through

    def __init__(self, engine: LocalEngine, **kw: Any):
        super().__init__(engine, **kw)
        self.weight_version = "default"
        self.version_lag_s = 0.0  # report a new weight_version only this long after an update
        self.running = threading.Event()
        self.running.set()
        self.groups: dict[str, Any] = {}

    def routes(self, app: web.Application) -> None:
        r = app.router
        for path in ("/health", "/health_generate"):
            r.add_get(path, lambda req: web.Response(status=200))
        for path in ("/model_info", "/get_model_info"):
            r.add_get(path, self.model_info)
        r.add_get("/get_weight_version", lambda req: web.json_response({"weight_version": self.weight_version}))
        r.add_get("/get_server_info", lambda req: web.json_response({"tp_size": 1, "dp_size": 1, "version": "stand-in"}))
        r.add_route("*", "/generate", self.generate)
        r.add_route("*", "/flush_cache", lambda req: web.Response(text="Cache flushed.\n"))
        r.add_post("/pause_generation", self.pause)
        r.add_post("/continue_generation", self.cont)
        r.add_post("/abort_request", lambda req: web.Response(status=200))
        r.add_post("/update_weights_from_disk", self.from_disk)
        r.add_post("/update_weights_from_tensor", self.from_tensor)
        r.add_post("/init_weights_update_group", self.init_group)
        r.add_post("/update_weights_from_distributed", self.from_distributed)

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response({"model_path": "stand-in", "tokenizer_path": "stand-in", "is_generation": True,
                                  "preferred_sampling_params": None, "weight_version": self.weight_version})

    async def generate(self, request: web.Request) -> web.Response:
        body = await request.json()
        ids, sp = body["input_ids"], body.get("sampling_params") or {}
        rid = body.get("rid") or uuid.uuid4().hex
        await self.run_engine(self.running.wait)  # held while paused, as SGLang holds new requests
        max_new = int(sp.get("max_new_tokens", 128))
        meta: dict[str, Any] = {"id": rid, "prompt_tokens": len(ids), "cached_tokens": 0,
                                "weight_version": self.weight_version}
        out_ids: list[int] = []
        if max_new > 0:
            gen = (await self.run_engine(self.engine.generate, [ids], _params(sp, max_new)))[0]
            self.answers[rid].append(gen)
            out_ids = gen.token_ids
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(gen.logprobs, gen.token_ids)]
            meta["finish_reason"] = ({"type": "stop", "matched": out_ids[-1]} if gen.finish_reason == "stop"
                                     else {"type": "length", "length": len(out_ids)})
        else:
            meta["output_token_logprobs"] = []
            meta["finish_reason"] = {"type": "length", "length": 0}
        start = body.get("logprob_start_len")
        if body.get("return_logprob") and start is not None and start >= 0:
            # entry 0 is always None; entry i is log p(ids[start + i] | ids[:start + i])
            lps = (await self.run_engine(self.engine.score, [ids[: start + 1]], [ids[start + 1:]]))[0]
            self.scores[rid].append(lps)
            meta["input_token_logprobs"] = [[None, ids[start], None]] + [[lp, t, None] for lp, t in zip(lps, ids[start + 1:])]
        meta["completion_tokens"] = len(out_ids)
        return web.json_response({"text": "", "output_ids": out_ids, "meta_info": meta})

    async def pause(self, request: web.Request) -> web.Response:
        self.running.clear()
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def cont(self, request: web.Request) -> web.Response:
        self.running.set()
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def _update(self, body: dict, named: Any = None, path: str | None = None) -> web.Response:
        if named is None and path is None:
            return web.json_response({"success": False, "message": "nothing to load"}, status=400)
        kw = {"path": path} if path is not None else {"named_tensors": named}
        await self.run_engine(lambda: self.engine.update_weights(**kw, version=self.engine.version), control=True)
        if body.get("weight_version") is not None:
            new = body["weight_version"]
            if self.version_lag_s > 0:
                threading.Timer(self.version_lag_s, lambda: setattr(self, "weight_version", new)).start()
            else:
                self.weight_version = new
        return web.json_response({"success": True, "message": "Succeeded to update model weights.",
                                  "num_paused_requests": 0})

    async def from_disk(self, request: web.Request) -> web.Response:
        body = await request.json()
        return await self._update(body, path=body.get("model_path"))

    async def from_tensor(self, request: web.Request) -> web.Response:
        from multiprocessing.reduction import ForkingPickler

        import torch.multiprocessing  # noqa: F401 - torch's reductions

        body = await request.json()
        named = ForkingPickler.loads(base64.b64decode(body["serialized_named_tensors"][0]))  # this TP rank: 0
        return await self._update(body, named=named)

    async def init_group(self, request: web.Request) -> web.Response:
        b = await request.json()
        if b.get("backend") != "gloo":
            return web.json_response({"success": False, "message": "the stand-in speaks gloo only"}, status=400)
        self.groups[b["group_name"]] = await self.run_engine(
            join_gloo_group, b["master_address"], int(b["master_port"]), int(b["world_size"]), int(b["rank_offset"]),
            b["group_name"], control=True)
        return web.json_response({"success": True, "message": "Succeeded to initialize custom process group."})

    async def from_distributed(self, request: web.Request) -> web.Response:
        b = await request.json()
        group = self.groups[b.get("group_name", "weight_update_group")]
        named = await self.run_engine(receive, group, b["names"], b["dtypes"], b["shapes"], control=True)
        return await self._update(b, named=named)


class _Loader:
    """vLLM's `model.load_weights(weights=...)`, over the LocalEngine."""

    def __init__(self, engine: LocalEngine):
        self.engine = engine

    def load_weights(self, weights: Any) -> None:
        self.engine.update_weights(list(weights), version=self.engine.version)


class StandInWorker(WeightLoaderExtension):
    """The real worker extension on a stand-in vLLM worker (one rank, gloo groups)."""

    def __init__(self, engine: LocalEngine):
        self.model_runner = types.SimpleNamespace(model=_Loader(engine))
        self.rank = 0

    def _make_group(self, backend: str, init_method: str, world_size: int, rank: int, group_name: str):
        host, port = init_method.removeprefix("tcp://").rsplit(":", 1)
        return join_gloo_group(host, int(port), world_size, rank, group_name)

    def _broadcast(self, tensor: torch.Tensor, group: Any) -> None:
        group.broadcast(tensor, 0).wait()


class VLLMServer(ProtocolServer):
    """vLLM's OpenAI-compatible server; `dev_mode` adds /pause, /resume, /reset_prefix_cache and
    /collective_rpc (served by `StandInWorker`, or failing like a worker without the extension)."""

    open_paths = ("/health",)  # vLLM's key middleware guards /v1 paths only; tests send the key everywhere

    def __init__(self, engine: LocalEngine, *, dev_mode: bool = True, extension: bool = True,
                 model_name: str = "tiny-glm5", **kw: Any):
        super().__init__(engine, **kw)
        self.dev_mode, self.extension, self.model_name = dev_mode, extension, model_name
        self.worker = StandInWorker(engine)

    def routes(self, app: web.Application) -> None:
        r = app.router
        r.add_get("/health", lambda req: web.Response(status=200))
        r.add_get("/v1/models", lambda req: web.json_response(
            {"object": "list", "data": [{"id": self.model_name, "object": "model", "owned_by": "vllm"}]}))
        r.add_post("/v1/completions", self.completions)
        if self.dev_mode:
            r.add_post("/pause", lambda req: web.json_response({"status": "paused"}))
            r.add_post("/resume", lambda req: web.json_response({"status": "resumed"}))
            r.add_post("/reset_prefix_cache", lambda req: web.Response(status=200))
            r.add_post("/collective_rpc", self.collective_rpc)

    async def completions(self, request: web.Request) -> web.Response:
        b = await request.json()
        if b.get("model") != self.model_name:
            return web.json_response({"error": {"message": f"The model `{b.get('model')}` does not exist.",
                                                "type": "NotFoundError", "code": 404}}, status=404)
        ids, choice = list(b["prompt"]), {"index": 0, "text": "", "stop_reason": None}
        rid = b.get("request_id") or uuid.uuid4().hex
        gen = (await self.run_engine(self.engine.generate, [ids], _params(b, int(b.get("max_tokens", 16)))))[0]
        self.answers[rid].append(gen)
        choice["finish_reason"] = gen.finish_reason
        if gen.finish_reason == "stop":
            choice["stop_reason"] = gen.token_ids[-1]
        if b.get("logprobs") is not None:
            toks = [f"token_id:{t}" if b.get("return_tokens_as_token_ids") else chr(0x2581) for t in gen.token_ids]
            choice["logprobs"] = {"text_offset": [0] * len(toks), "token_logprobs": gen.logprobs, "tokens": toks,
                                  "top_logprobs": [{tk: lp} for tk, lp in zip(toks, gen.logprobs)]}
        else:
            choice["logprobs"] = None
        choice["prompt_logprobs"] = None
        if b.get("prompt_logprobs") is not None:
            lps = (await self.run_engine(self.engine.score, [ids[:1]], [ids[1:]]))[0]
            self.scores[rid].append(lps)
            choice["prompt_logprobs"] = [None] + [{str(t): {"logprob": lp, "rank": 1, "decoded_token": ""}}
                                                  for t, lp in zip(ids[1:], lps)]
        if b.get("return_token_ids"):
            choice["token_ids"], choice["prompt_token_ids"] = gen.token_ids, ids
        return web.json_response({"id": f"cmpl-{rid}", "object": "text_completion",
                                  "created": int(time.time()), "model": self.model_name, "choices": [choice],
                                  "usage": {"prompt_tokens": len(ids), "completion_tokens": len(gen.token_ids),
                                            "total_tokens": len(ids) + len(gen.token_ids)}})

    async def collective_rpc(self, request: web.Request) -> web.Response:
        b = await request.json()
        method = getattr(self.worker, b["method"], None) if self.extension else None
        if method is None:
            return web.json_response({"error": f"'Worker' object has no attribute '{b['method']}'"}, status=500)
        result = await self.run_engine(method, *b.get("args", []), control=True)
        return web.json_response({"results": [result]})


def serve_main(kind: str, argv: list[str]) -> None:
    """Run a stand-in server until SIGTERM (used as a fake `sglang.launch_server` / vLLM server)."""
    from glmlight.models.loading import load_causal_lm
    from glmlight.models.tokenizer import build_char_tokenizer

    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--api-key", default=None)
    args, _ = ap.parse_known_args(argv)
    tok = build_char_tokenizer()
    engine = LocalEngine(load_causal_lm(None, tok, preset="test", seed=0))
    cls = SGLangServer if kind == "sglang" else VLLMServer
    server = cls(engine, api_key=args.api_key, port=args.port).start()
    print(f"stand-in {kind} server ready on {server.url}", flush=True)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    done.wait()
    server.close()


# ---------------------------------------------------------------------- test helpers
# ---------------------------------------------------------------- shared by the client tests
@pytest.fixture(scope="module")
def model() -> Any:
    """The test-size GLM-5 that backs every protocol server and the reference engine."""
    from glmlight.models.loading import load_causal_lm
    from glmlight.models.tokenizer import build_char_tokenizer

    return load_causal_lm(None, build_char_tokenizer(), preset="test", seed=0).eval()


@pytest.fixture(scope="module")
def ref(model: Any) -> Any:
    """An embedded engine on the same weights: what a server's answers must equal."""
    engine = LocalEngine(model)
    yield engine
    engine.close()


def greedy(tokenizer: Any, n: int = 5) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=n, stop_token_ids=[tokenizer.eos_token_id])


def expected(ref: Any, ps: list[list[int]], sp: SamplingParams) -> list:
    """What the embedded engine answers to each prompt on its own."""
    return [ref.generate([p], sp)[0] for p in ps]


def assert_same(got: list, want: list, served: list | None = None) -> None:
    """Token ids and finish reasons equal; log-probs equal up to float noise (the embedded engine
    itself moves the last bit between calls: vectorised sums depend on memory alignment). With
    `served` (per request, every answer the server computed for it), the log-probs must be
    exactly one of those: nothing is lost in transport."""
    import pytest

    ids, want_ids = [g.token_ids for g in got], [w.token_ids for w in want]
    assert ids == want_ids, f"token ids {ids} != {want_ids}"
    assert [g.finish_reason for g in got] == [w.finish_reason for w in want]
    assert [x for g in got for x in g.logprobs] == pytest.approx([x for w in want for x in w.logprobs], abs=1e-5)
    if served is not None:
        for i, (g, answers) in enumerate(zip(got, served)):
            assert g.logprobs in [a.logprobs for a in answers], f"answer {i}: {g.logprobs} not among {answers}"


def prompts(tokenizer: Any, n: int) -> list[list[int]]:
    from glmlight.models.tokenizer import encode_chat

    return [encode_chat(tokenizer, [{"role": "user", "content": f"{i}+{i % 3}="}]) for i in range(n)]


def standin_script(tmp_path: Any, kind: str, *, exit_code: int | None = None, message: str = "") -> str:
    """A stand-in server executable: serves `kind` on --port, or prints `message` and exits."""
    import os

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.path.join(str(tmp_path), f"fake_{kind}_server.py")
    body = (f"import sys\nprint({message!r}, flush=True)\nsys.exit({exit_code})\n" if exit_code is not None else
            f"import sys\nsys.path.insert(0, {repo!r})\nfrom tests.protocol_servers import serve_main\n"
            f"serve_main({kind!r}, sys.argv[1:])\n")
    with open(path, "w") as f:
        f.write(body)
    return path


def launch_config(tmp_path: Any, backend: str, command: list[str], **server: Any) -> Any:
    """The validated config for a managed launch, plus the `launch_command` override (a key
    ServerConfig does not have; the engines read it with getattr)."""
    from omegaconf import OmegaConf

    from glmlight.config import validate

    srv = {"launch": True, "launch_timeout_s": 60, "request_timeout_s": 10, "max_retries": 2,
           "retry_backoff_s": 0.05, "weight_sync_dir": str(tmp_path / "weights"), "model_path": str(tmp_path), **server}
    cfg = validate({"rollout": {"backend": backend, "server": srv}, "trainer": {"default_root_dir": str(tmp_path)}})
    plain = OmegaConf.to_container(cfg, resolve=True)
    plain["rollout"]["server"]["launch_command"] = command
    return OmegaConf.create(plain)
