"""Async HTTP pieces shared by the server engines (SGLang, vLLM).

- `LoopThread`: one asyncio loop in a dedicated daemon thread. The engine protocol
  is synchronous and may be called from a thread that already runs a loop (a
  notebook, an async data module), where `asyncio.run` would fail; submitting to
  our own loop works from anywhere and `close()` stops it cleanly.
- `UrlPool`: picks a server per attempt (least in flight, round robin on ties,
  servers that just failed cool down), so a retry can land on a healthy server.
- `HttpClient`: bounded in-flight requests, `Authorization: Bearer <key>` read from
  the environment variable named in the config (the key itself is never logged; a variable
  that is not set means "no key"), retries with exponential backoff on connection errors,
  timeouts and 5xx — never on 4xx, nor on a 5xx the caller marks permanent (vLLM's
  "Call to collective_rpc method failed") —, a server that answers "paused" (vLLM 0.33's 503
  "Generation is paused") waited for without spending attempts, and one-line `EngineError`s
  naming the URL and what was wrong.

The caller chooses the request id per attempt (`rid_for(attempt)`): vLLM gets the same id on
every attempt (duplicates are allowed there), SGLang a fresh one per attempt (it answers 400
"Duplicate request ID" while an earlier attempt is still registered); either way the answer is
collected under the logical request's id.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp

from glmlight.errors import EngineError

T = TypeVar("T")
log = logging.getLogger(__name__)


def new_rid() -> str:
    """A fresh request id. Fixed length, so no id is a prefix of another (SGLang's
    /abort_request matches by prefix)."""
    return f"glm-{uuid.uuid4().hex}"


class LoopThread:
    """An asyncio event loop running in its own daemon thread."""

    def __init__(self, name: str = "glmlight-http"):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        self._closed = False

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        if self._closed:
            coro.close()
            raise EngineError("the server engine is closed")
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("a synchronous engine call was made from the engine's own event loop")
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        return self.submit(coro).result(timeout)

    def close(self, cleanup: Coroutine[Any, Any, Any] | None = None) -> None:
        if self._closed:
            if cleanup is not None:
                cleanup.close()
            return
        if cleanup is not None:
            try:
                self.run(cleanup, timeout=10)
            except Exception:  # noqa: BLE001 - closing must not fail
                pass
        self._closed = True
        pending = asyncio.run_coroutine_threadsafe(_cancel_all(), self.loop)
        try:
            pending.result(timeout=5)
        except Exception:  # noqa: BLE001
            pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self.loop.close()


async def _cancel_all() -> None:
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


class UrlPool:
    """Chooses a server URL per attempt. Used only from the loop thread (no locks)."""

    def __init__(self, urls: Iterable[str], cooldown_s: float = 1.0):
        self.urls = list(urls)
        if not self.urls:
            raise EngineError("no server URL given (rollout.server.urls is empty)")
        self.in_flight = {u: 0 for u in self.urls}
        self._cool_until = {u: 0.0 for u in self.urls}
        self._order = itertools.count()
        self._last_pick = {u: -1 for u in self.urls}
        self.cooldown_s = cooldown_s
        self.avoid: set[str] = set()  # servers to use only when no other is left (e.g. awaiting a re-sync)

    def acquire(self) -> str:
        now = time.monotonic()
        url = min(self.urls, key=lambda u: (u in self.avoid, self._cool_until[u] > now, self.in_flight[u],
                                            self._last_pick[u]))
        self.in_flight[url] += 1
        self._last_pick[url] = next(self._order)
        return url

    def release(self, url: str, ok: bool) -> None:
        self.in_flight[url] -= 1
        if not ok:
            self._cool_until[url] = time.monotonic() + self.cooldown_s


@dataclass
class HttpSettings:
    api_key_env: str | None = None
    max_in_flight: int = 64
    timeout_s: float = 600.0
    max_retries: int = 3
    backoff_s: float = 0.5

    @classmethod
    def from_config(cls, server: Any) -> HttpSettings:
        return cls(api_key_env=server.api_key_env, max_in_flight=server.max_in_flight,
                   timeout_s=server.request_timeout_s, max_retries=server.request_retries,
                   backoff_s=server.request_retry_backoff_s)


class ServerUnavailable(EngineError):
    """Retries are spent: the server refused connections, dropped them, timed out or kept failing."""

    def __init__(self, message: str, refused: bool = False):
        super().__init__(message)
        self.refused = refused


class Rejected(EngineError):
    """The server answered with a 4xx status (not retried)."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


class AuthError(EngineError):
    """The server refused the API key, or wants one (HTTP 401/403): the run stops."""

    fatal = True


class ServerFailed(EngineError):
    """The server answered with an error that retrying cannot fix (e.g. a failed weight load)."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


class _Retryable(Exception):
    """A transient failure: connection refused or dropped, timeout, 5xx."""

    def __init__(self, reason: str, refused: bool = False, dropped: bool = False):
        super().__init__(reason)
        self.refused = refused
        self.dropped = dropped


class _Paused(Exception):
    """The server holds no requests while paused and said so (vLLM 0.33: 503 "Generation is paused")."""


class HttpClient:
    """JSON over HTTP with auth, bounded concurrency and retries; see the module docstring."""

    def __init__(self, name: str, settings: HttpSettings,
                 on_connection_error: Callable[[], None] | None = None,
                 on_server_error: Callable[[str, bool], None] | None = None):
        self.name = name
        self.on_server_error = on_server_error  # (url, connection lost): e.g. mark the server for a re-sync
        self.settings = settings
        self.api_key = _read_key(settings.api_key_env)
        self.on_connection_error = on_connection_error  # e.g. raise if a managed server died
        self.loop = LoopThread(f"glmlight-{name.lower()}")
        self._session: aiohttp.ClientSession | None = None
        self._sem: asyncio.Semaphore | None = None
        self.num_retries = 0

    # ------------------------------------------------------------------ sync facade
    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        return self.loop.run(coro, timeout)

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return self.loop.submit(coro)

    def close(self) -> None:
        self.loop.close(self._close_session())

    async def _close_session(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    # ------------------------------------------------------------------ requests
    def headers(self, rid: str | None = None) -> dict[str, str]:
        h = {"Content-Type": "application/json"}
        if self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        if rid:
            h["X-Request-Id"] = rid
        return h

    async def request(self, path: str, payload: Any = None, *, url: str | None = None, pool: UrlPool | None = None,
                      method: str = "POST", rid: str | None = None, timeout_s: float | None = None,
                      attempts: int | None = None, expect_json: bool = True, allow_404: bool = False,
                      on_retry: Callable[[str, str, str | None], Awaitable[None]] | None = None,
                      with_url: bool = False,
                      permanent: Callable[[int, str], bool] | None = None,
                      rid_for: Callable[[int], str] | None = None,
                      payload_for: Callable[[str, str | None], Any] | None = None) -> Any:
        """Send one logical request; return its JSON (or text) body, or None on 404 when allowed
        (with `with_url`: a tuple of the answering URL and the body).

        Either `url` (a fixed server) or `pool` (choose per attempt) must be given. `rid_for(attempt)`
        gives the request id of each attempt (default: `rid` on all), `payload_for(url, rid)` the body
        for that server and id (default: `payload`). `permanent(status, text)` marks a 5xx that is not retried.
        """
        if (url is None) == (pool is None):
            raise ValueError("give exactly one of url or pool")
        attempts = attempts if attempts is not None else self.settings.max_retries + 1
        timeout = aiohttp.ClientTimeout(total=timeout_s or self.settings.timeout_s)
        last, target, refused = "", url or "", False
        paused_until: float | None = None
        attempt = 0
        while attempt < max(attempts, 1):
            target = pool.acquire() if pool is not None else url
            ok = False
            this_rid = rid_for(attempt) if rid_for is not None else rid
            body = payload_for(target, this_rid) if payload_for is not None else payload
            try:
                result = await self._attempt(method, target, path, body, this_rid, timeout, expect_json, allow_404,
                                             permanent)
                ok = True
                return (target, result) if with_url else result
            except _Paused:
                ok = True  # the server is fine, only paused: no cool-down, no attempt spent
                now = time.monotonic()
                paused_until = paused_until or now + self.settings.timeout_s
                if now > paused_until:
                    last = f"still paused after {self.settings.timeout_s:g}s"
                    break
                await asyncio.sleep(max(self.settings.backoff_s, 0.05))
                continue
            except _Retryable as e:
                last, refused = str(e), e.refused
                if self.on_server_error is not None:
                    self.on_server_error(target, e.refused or e.dropped)
            finally:
                if pool is not None:
                    pool.release(target, ok)
            if self.on_connection_error is not None:
                self.on_connection_error()
            attempt += 1
            if attempt < attempts:
                self.num_retries += 1
                if on_retry is not None:
                    await on_retry(target, last, this_rid)
                await asyncio.sleep(min(self.settings.backoff_s * 2 ** (attempt - 1), 30.0))
        hint = "; is it running? (rollout.server.urls)" if refused else ""
        raise ServerUnavailable(f"{self.name} server at {target}: {last} on {path} after {attempts} attempt(s){hint}",
                                refused=refused)

    async def _attempt(self, method: str, url: str, path: str, payload: Any, rid: str | None,
                       timeout: aiohttp.ClientTimeout, expect_json: bool, allow_404: bool,
                       permanent: Callable[[int, str], bool] | None = None) -> Any:
        if self._session is None:
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
            self._sem = asyncio.Semaphore(self.settings.max_in_flight)
        assert self._sem is not None
        async with self._sem:
            try:
                async with self._session.request(method, url + path, json=payload, headers=self.headers(rid),
                                                 timeout=timeout) as resp:
                    status, text = resp.status, await resp.text()
            except aiohttp.ClientConnectorError as e:
                raise _Retryable(f"connection refused ({_why(e)})", refused=True) from None
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError, aiohttp.ClientPayloadError) as e:
                raise _Retryable(f"connection dropped ({_why(e)})", dropped=True) from None
            except asyncio.TimeoutError:
                raise _Retryable(f"no answer within {timeout.total:g}s") from None
        return self._interpret(url, path, status, text, expect_json, allow_404, permanent)

    def _interpret(self, url: str, path: str, status: int, text: str, expect_json: bool, allow_404: bool,
                   permanent: Callable[[int, str], bool] | None = None) -> Any:
        if status in (401, 403):
            if self.api_key:
                raise AuthError(f"{self.name} server at {url} refused the API key from ${self.settings.api_key_env} "
                                  f"(HTTP {status} on {path})")
            env = self.settings.api_key_env
            hint = (f"${env} is not set" if env else
                    "set rollout.server.api_key_env to the name of the variable that holds it")
            raise AuthError(f"{self.name} server at {url} requires an API key (HTTP {status} on {path}); {hint}")
        if status == 404 and allow_404:
            return None
        if status == 503 and "paused" in text.lower():
            raise _Paused()
        if status >= 500 and permanent is not None and permanent(status, text):
            raise ServerFailed(f"{self.name} server at {url} failed {path} with HTTP {status}: "
                               f"{_excerpt(error_message(text))}", status)
        if status >= 500:
            raise _Retryable(f"HTTP {status} ({_excerpt(text)})")
        if status >= 400:
            raise Rejected(f"{self.name} server at {url} rejected {path} with HTTP {status}: "
                           f"{_excerpt(error_message(text))}", status)
        if not expect_json:
            return text
        if not text.strip():
            raise EngineError(f"{self.name} server at {url} answered {path} with HTTP {status} and an empty body "
                              "(expected JSON; is something else listening on that port, e.g. a proxy?)")
        try:
            return json.loads(text)
        except ValueError:
            raise EngineError(f"{self.name} server at {url} answered {path} with HTTP {status} and a body that is "
                              f"not JSON: {_excerpt(text)!r} (is something else listening on that port, e.g. a "
                              "proxy?)") from None


def error_message(text: str) -> str:
    """The message of an error body: {"error": {"message"}} (vLLM, SGLang), {"error": str} (SGLang
    0.5.23's /generate on an unknown sampling_params key), {"object": "error", "message": str, ...}
    (SGLang's request validation errors, FastAPI's), or the text itself."""
    try:
        body = json.loads(text)
    except ValueError:
        return text
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict):
            return str(err.get("message", err))
        return str(err if "error" in body else body.get("message", body))
    return text


def _read_key(env: str | None) -> str | None:
    """The key in $env; an unset (or empty) variable means no key."""
    if not env:
        return None
    key = os.environ.get(env)
    if not key:
        log.info("rollout.server.api_key_env names $%s, which is not set: no API key is sent", env)
        return None
    return key


def _why(e: BaseException) -> str:
    os_error = getattr(e, "os_error", None)
    text = getattr(os_error, "strerror", None) or str(e) or type(e).__name__
    return text.splitlines()[0][:120]


def _excerpt(text: str, n: int = 160) -> str:
    one = " ".join(text.split())
    return one if len(one) <= n else one[: n - 3] + "..."


def get_field(body: Any, dotted: str, url: str, path: str, name: str, kind: type | tuple[type, ...] | None = None) -> Any:
    """`body[a][b]...` for a dotted key, or a one-line EngineError naming the URL and the missing field."""
    cur = body
    for part in dotted.split("."):
        if isinstance(cur, dict) and part in cur:
            cur = cur[part]
        elif isinstance(cur, list) and part.isdigit() and int(part) < len(cur):
            cur = cur[int(part)]
        else:
            raise EngineError(f"{name} server at {url} answered {path} without {dotted}")
    if kind is not None and not isinstance(cur, kind):
        raise EngineError(f"{name} server at {url} answered {path} with {dotted} of type {type(cur).__name__}")
    return cur
