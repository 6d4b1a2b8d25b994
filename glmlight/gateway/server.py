"""The gateway's HTTP server: aiohttp on a free localhost port, in a thread with its own event loop.

Routes (each also under `/e/<key>`, the episode's own base URL, for agents that cannot set a key):

- POST /v1/chat/completions (`openai_wire`), POST /v1/responses (`responses_wire`) and POST /v1/messages
  (`anthropic_wire`): one turn of the episode the key names (`Authorization: Bearer <key>` or
  `x-api-key: <key>`);
- POST /v1/messages/count_tokens: the ids the chat template renders for a Messages request
  (`{"input_tokens": N}`); it changes nothing in the episode;
- POST /reward (or /v1/reward) `{"reward": <number>, "info": {...}}`: the agent reports its episode's
  reward;
- GET /v1/models and GET /v1/models/{id}: the one model served (another id: a 404).

An episode's requests are served one at a time, in the order they arrive; the engine call runs in
a worker thread, so requests of many episodes reach the engine together (the embedded engine
batches them). A turn whose client went away before its whole answer was written (disconnected or
timed out) is withdrawn from the episode's record: the agent never saw it, so it is not trained on.
Every error goes back in the wire's own error form with `x-should-retry: false` (the official
clients would otherwise retry some of them), a route or method the gateway does not serve too (a
404 / 405 listing the routes served; Anthropic's form under /v1/messages, OpenAI's elsewhere); a
malformed turn fails its episode.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from aiohttp import web

from glmlight.gateway import anthropic_wire, openai_wire, responses_wire
from glmlight.gateway.episode import GatewayEpisode
from glmlight.gateway.messages import AUTH, BAD_REQUEST, NOT_FOUND, TOO_LARGE, WireError, bad_request

log = logging.getLogger(__name__)
NO_RETRY = {"x-should-retry": "false"}


class GatewayServer:
    def __init__(self, host: str = "127.0.0.1", port: int = 0, workers: int = 64, model_name: str = "glmlight"):
        self.host, self.port, self.model_name = host, port, model_name
        self.episodes: dict[str, GatewayEpisode] = {}
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="glmlight-gateway-turn")
        self._locks: dict[str, asyncio.Lock] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    # ----------------------------------------------------------------- life
    def __enter__(self) -> "GatewayServer":
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def start(self) -> None:
        ready: dict[str, Any] = {}
        started = threading.Event()
        self._loop = asyncio.new_event_loop()

        def main() -> None:
            asyncio.set_event_loop(self._loop)
            runner = None
            try:
                runner = self._loop.run_until_complete(self._listen())
            except BaseException as e:  # noqa: BLE001 - re-raised in start()
                ready["error"] = e
            started.set()
            if runner is None:
                return
            self._loop.run_forever()
            self._loop.run_until_complete(runner.cleanup())
            self._loop.close()

        self._thread = threading.Thread(target=main, name="glmlight-gateway", daemon=True)
        self._thread.start()
        started.wait()
        if "error" in ready:
            raise RuntimeError(f"the agent gateway cannot listen on {self.host}:{self.port}: {ready['error']}")

    async def _listen(self) -> web.AppRunner:
        app = web.Application(client_max_size=64 * 2**20, middlewares=[_wire_errors])
        for prefix in ("", "/e/{key}"):
            app.router.add_post(prefix + "/v1/chat/completions", lambda r: self._turn(r, openai_wire))
            app.router.add_post(prefix + "/v1/responses", lambda r: self._turn(r, responses_wire))
            app.router.add_post(prefix + "/v1/messages", lambda r: self._turn(r, anthropic_wire))
            app.router.add_post(prefix + "/v1/messages/count_tokens", self._count_tokens)
            app.router.add_post(prefix + "/reward", self._reward)
            app.router.add_post(prefix + "/v1/reward", self._reward)
            app.router.add_get(prefix + "/v1/models", self._models)
            app.router.add_get(prefix + "/v1/models/{model}", self._model)
        # a request still in flight when the rollout ends (its agent gone) is not waited for
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
        await runner.setup()
        site = web.TCPSite(runner, self.host, self.port, backlog=1024)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]
        return runner

    def stop(self) -> None:
        if self._loop is not None and self._thread is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ----------------------------------------------------------------- episodes
    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def add(self, ep: GatewayEpisode) -> str:
        """Serve `ep`; returns its own base URL."""
        self.episodes[ep.key] = ep
        return f"{self.url}/e/{ep.key}"

    def _episode(self, request: web.Request) -> GatewayEpisode:
        key = request.match_info.get("key")
        if key is None:
            auth = request.headers.get("Authorization", "")
            key = auth[7:].strip() if auth.lower().startswith("bearer ") else request.headers.get("x-api-key")
        ep = self.episodes.get(key or "")
        if ep is None:
            raise WireError(401, AUTH, "unknown API key: each episode has its own key or base URL, handed to its agent")
        return ep

    # ----------------------------------------------------------------- handlers
    async def _turn(self, request: web.Request, wire: Any) -> web.StreamResponse:
        ep = None
        try:
            ep = self._episode(request)
            ep.enter()
            try:
                req = wire.parse_request(await _json(request))
                lock = self._locks.setdefault(ep.key, asyncio.Lock())
                async with lock:  # held until the answer is sent: `_answer` may withdraw the turn
                    result = await _served(asyncio.get_running_loop().run_in_executor(self._pool, ep.turn, req), ep)
                    return await self._answer(request, wire, req, result, ep)
            finally:
                ep.leave()
        except WireError as e:
            if ep is not None and e.kind == BAD_REQUEST:
                ep.fail("bad_request", e.message)
            return web.json_response(wire.error_body(e), status=e.status, headers=NO_RETRY)
        except Exception as e:  # noqa: BLE001 - a gateway bug fails the episode, not the run
            log.exception("agent gateway: a request of %s failed", ep.id if ep else "an unknown episode")
            if ep is not None:
                ep.fail("gateway_error", f"{type(e).__name__}: {e}")
            err = WireError(500, "server", f"the gateway failed on this request: {type(e).__name__}: {e}")
            return web.json_response(wire.error_body(err), status=500, headers=NO_RETRY)

    async def _answer(self, request: web.Request, wire: Any, req: Any, result: Any,
                      ep: GatewayEpisode) -> web.StreamResponse:
        """Send the turn. A client gone before the whole answer was written (disconnected, timed out) never
        received it: the turn is withdrawn from the episode's record (`GatewayEpisode.withdraw`)."""
        model = req.model or self.model_name
        # the OpenAI wires' answers depend on the request (a Responses answer repeats its settings; Chat
        # Completions' finish_reason, on a named tool_choice); Anthropic's on the turn alone
        if req.stream:
            events = anthropic_wire.stream(result, model) if wire is anthropic_wire else wire.stream(result, model, req)
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        else:
            body = (anthropic_wire.response(result, model) if wire is anthropic_wire
                    else wire.response(result, model, req))
            events, resp = [], web.json_response(body)
        try:
            if _gone(request):
                raise ConnectionResetError("the client closed the connection while the turn was generated")
            await resp.prepare(request)
            for e in events:
                await resp.write(e)
            await resp.write_eof()
        except ConnectionResetError as e:
            ep.withdraw(f"{'streamed' if req.stream else 'non-streamed'} answer: {e}")
        except asyncio.CancelledError:
            ep.withdraw("the request was cancelled while its answer was sent")
            raise
        return resp

    async def _reward(self, request: web.Request) -> web.Response:
        ep = None
        try:
            ep = self._episode(request)
            body = await _json(request)
            reward = body.get("reward") if isinstance(body, dict) else None
            info = body.get("info", {}) if isinstance(body, dict) else None
            if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
                raise bad_request(f"reward must be a finite number, got {reward!r}")
            if not isinstance(info, dict):
                raise bad_request("info must be an object")
            ep.report(float(reward), info)
        except WireError as e:
            if ep is not None and e.kind == BAD_REQUEST:
                ep.fail("bad_request", e.message)
            return web.json_response(openai_wire.error_body(e), status=e.status, headers=NO_RETRY)
        return web.json_response({"ok": True})

    async def _count_tokens(self, request: web.Request) -> web.Response:
        """Anthropic's token count: the ids the chat template renders for the request (its prompt, as a turn
        that opens a segment starts from). The episode's record is not touched, and a malformed request
        gets its error without failing the episode (the turn that sends it would fail it)."""
        try:
            ep = self._episode(request)
            req = anthropic_wire.parse_count_request(await _json(request))
            ep.enter()
            try:
                ids = await asyncio.get_running_loop().run_in_executor(
                    self._pool, ep.codec.encode, req.messages, req.tools, req.prefill)
            finally:
                ep.leave()
        except WireError as e:
            return web.json_response(anthropic_wire.error_body(e), status=e.status, headers=NO_RETRY)
        return web.json_response({"input_tokens": len(ids)})

    def _model_record(self) -> dict[str, Any]:
        return {"id": self.model_name, "object": "model", "created": 0, "owned_by": "glmlight"}

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._model_record()]})

    async def _model(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        if name != self.model_name:
            err = WireError(404, NOT_FOUND, f"the model {name!r} does not exist: this gateway serves one model, "
                                            f"{self.model_name!r} (every answer comes from the policy)")
            return web.json_response(openai_wire.error_body(err, "model_not_found"), status=404, headers=NO_RETRY)
        return web.json_response(self._model_record())


_KINDS = {404: NOT_FOUND, 413: TOO_LARGE}


@web.middleware
async def _wire_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """aiohttp's own errors (no such route, a method the route does not take, a body over the size limit) in
    the wire's error form with `x-should-retry: false`: Anthropic's under /v1/messages, OpenAI's elsewhere."""
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        where = f"{request.method} {request.path}"
        if isinstance(e, web.HTTPMethodNotAllowed):
            message = f"the method {request.method} is not allowed on {request.path} (allowed: " \
                      f"{', '.join(sorted(e.allowed_methods))})"
        elif isinstance(e, web.HTTPNotFound):
            message = f"unknown route: {where}; this gateway serves {', '.join(_routes(request.app))}"
        else:
            message = f"{where}: {e.reason}"
        wire = anthropic_wire if "/v1/messages" in request.path else openai_wire
        headers = dict(NO_RETRY)
        if e.headers.get("Allow"):
            headers["Allow"] = e.headers["Allow"]
        err = WireError(e.status, _KINDS.get(e.status, BAD_REQUEST), message)
        return web.json_response(wire.error_body(err), status=e.status, headers=headers)


def _routes(app: web.Application) -> list[str]:
    """The routes served, each once (the episode's own base URL, /e/<key>, serves the same ones)."""
    out = []
    for route in app.router.routes():
        path = route.resource.canonical if route.resource is not None else ""
        if route.method != "HEAD" and not path.startswith("/e/"):
            out.append(f"{route.method} {path}")
    return out


async def _served(turn: asyncio.Future, ep: GatewayEpisode) -> Any:
    """The turn's result. A handler cancelled meanwhile (a server that cancels handlers when their client
    disconnects, or the rollout's end) still waits for the turn, then withdraws it: its client is gone."""
    try:
        return await asyncio.shield(turn)
    except asyncio.CancelledError:
        try:
            await turn
        except Exception:  # noqa: BLE001 - the turn's own error: nothing was recorded to withdraw
            raise asyncio.CancelledError from None
        ep.withdraw("the request was cancelled while its turn was generated")
        raise


def _gone(request: web.Request) -> bool:
    """Whether the client has closed its connection."""
    transport = request.transport
    return transport is None or transport.is_closing()


async def _json(request: web.Request) -> Any:
    try:
        return await request.json()
    except Exception:  # noqa: BLE001 - any body that is not JSON
        raise bad_request("the request body is not valid JSON") from None
