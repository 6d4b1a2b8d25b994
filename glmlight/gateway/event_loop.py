"""The one event loop that runs every coroutine agent of the process (`AGENT_LOOP`).

Agent frameworks keep async clients for the whole process (the OpenAI Agents SDK makes one
`AsyncOpenAI`, hence one `httpx.AsyncClient`, and reuses it for every run): their connections and
locks belong to the loop that first used them. So every coroutine agent of every episode and every
rollout runs as a task on one long-lived loop, in a thread that owns it, started on first use and
closed when the process exits. An episode's agent runs in a context of its own: the tasks it starts
(directly or through its libraries) are its episode's, and those still running when its agent
returns, fails or is cancelled are cancelled and awaited before the episode counts as finished, so
nothing an episode leaves behind runs into the next one or is reported as never retrieved.

The loop is shared: a coroutine agent must not block it (a blocking agent is a plain function, and
runs in a thread of its own).
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextvars
import logging
import threading
from typing import Any, Coroutine

log = logging.getLogger(__name__)

LEFTOVER_TIMEOUT_S = 10.0  # how long the tasks an episode left behind get to finish once cancelled

_OWNER: contextvars.ContextVar[set[asyncio.Task] | None] = contextvars.ContextVar("glmlight_agent_tasks",
                                                                                  default=None)


def _task_factory(loop: asyncio.AbstractEventLoop, coro: Coroutine, **kwargs: Any) -> asyncio.Task:
    """asyncio's own tasks, each recorded in the episode whose context starts it."""
    task = asyncio.Task(coro, loop=loop, **kwargs)
    context = kwargs.get("context")
    owned = context.get(_OWNER) if context is not None else _OWNER.get()
    if owned is not None:
        owned.add(task)
        task.add_done_callback(owned.discard)
    return task


class AgentEventLoop:
    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def loop(self) -> asyncio.AbstractEventLoop:
        """The loop, started on first use (and again after `close`)."""
        with self._lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                loop.set_task_factory(_task_factory)
                started = threading.Event()

                def main() -> None:
                    asyncio.set_event_loop(loop)
                    loop.call_soon(started.set)
                    loop.run_forever()

                self._thread = threading.Thread(target=main, name="glmlight-agent-loop", daemon=True)
                self._thread.start()
                started.wait()
                self._loop = loop
            return self._loop

    def submit(self, coro: Coroutine, name: str) -> concurrent.futures.Future:
        """Run an episode's agent coroutine on the loop; cancelling the future cancels it (and what it
        started). The future is done once the tasks it left behind are cancelled and awaited."""
        return asyncio.run_coroutine_threadsafe(self._episode(coro, name), self.loop())

    async def _episode(self, coro: Coroutine, name: str) -> Any:
        owned: set[asyncio.Task] = set()
        _OWNER.set(owned)  # this task's context: what the agent starts is recorded in `owned`
        try:
            return await coro
        finally:
            await _settle(owned, name)

    def close(self) -> None:
        """Cancel whatever still runs, finish the loop's async generators and executor, and close it."""
        with self._lock:
            loop, thread, self._loop, self._thread = self._loop, self._thread, None, None
        if loop is None or thread is None:
            return
        if thread.is_alive():
            try:
                asyncio.run_coroutine_threadsafe(_shutdown(loop), loop).result(timeout=LEFTOVER_TIMEOUT_S + 5)
            except Exception as e:  # noqa: BLE001 - closing anyway
                log.warning("agent event loop: shutdown did not finish: %s: %s", type(e).__name__, e)
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout=5)
        if not thread.is_alive():
            loop.close()


async def _settle(owned: set[asyncio.Task], name: str) -> None:
    """Cancel the tasks of `owned` still running and wait for them (their outcome retrieved)."""
    leftovers = [t for t in owned if not t.done()]
    if not leftovers:
        return
    for t in leftovers:
        t.cancel()
    done, pending = await asyncio.wait(leftovers, timeout=LEFTOVER_TIMEOUT_S)
    for t in done:
        if not t.cancelled() and t.exception() is not None:
            log.debug("agent of %s: a task it left behind failed: %r", name, t.exception())
    if pending:
        log.warning("agent of %s: %d task(s) it left behind ignored cancellation for %gs", name, len(pending),
                    LEFTOVER_TIMEOUT_S)


async def _shutdown(loop: asyncio.AbstractEventLoop) -> None:
    tasks = [t for t in asyncio.all_tasks(loop) if t is not asyncio.current_task()]
    for t in tasks:
        t.cancel()
    if tasks:
        await asyncio.wait(tasks, timeout=LEFTOVER_TIMEOUT_S)
    await loop.shutdown_asyncgens()
    await loop.shutdown_default_executor()


AGENT_LOOP = AgentEventLoop()
atexit.register(AGENT_LOOP.close)
