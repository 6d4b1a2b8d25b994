"""Where synchronous reward calls run: daemon worker threads, or worker processes.

`ThreadWorkers`: at most one call per thread; a call that outlives its timeout is
abandoned (Python cannot stop a thread): its thread is taken out of the pool, finishes
on its own (its result is dropped) and exits; idle threads exit after `IDLE_EXIT_S`.

A batched reward (`batched = True`, glmlight/rewards/styles.py: TRL-style functions) is called on a list of
samples (one prompt's group) and gives one result per sample: (float, info), or the exception that fails
that sample alone (e.g. the reward returned None for it).

`ProcessWorkers`: persistent worker processes forked from multiprocessing's fork server
(the reward is pickled to each once). A call that outlives its timeout is killed with its
whole process group (SIGKILL) and the worker replaced; a worker that dies mid-call fails
that call. Workers die with their parent (PR_SET_PDEATHSIG) and ignore Ctrl-C.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import itertools
import math
import multiprocessing
import os
import pickle
import queue
import signal
import sys
import threading
import traceback
from typing import Any, Callable

from glmlight.errors import GlmlightError

IDLE_EXIT_S = 5.0
PROCESS_START_TIMEOUT_S = 120.0
_names = itertools.count()


class RewardError(GlmlightError):
    """The reward machinery cannot go on (a worker cannot load the reward, too many hung calls)."""


def unpack(out: Any) -> tuple[float, dict[str, Any]]:
    """A reward's output (a float, or (float, info)) as (float, dict); a non-finite value raises."""
    if isinstance(out, tuple):
        value, info = out
    else:
        value, info = out, {}
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"reward is not finite: {value}")
    return value, dict(info)


class RemoteRewardError(RuntimeError):
    """The reward raised in a worker process; `remote_traceback` is its traceback there."""

    def __init__(self, message: str, remote_traceback: str = ""):
        super().__init__(message)
        self.remote_traceback = remote_traceback


class NoScore(ValueError):
    """A batched reward returned None for a sample: it cannot score it (TRL's convention)."""


def is_batched(fn: Any) -> bool:
    return bool(getattr(fn, "batched", False))


def call_reward(fn: Callable[[Any], Any], sample: Any) -> Any:
    """Call a reward synchronously on one sample (an awaitable result is run to completion here), or a
    batched reward on a list of samples (one result per sample: (float, info) or an exception)."""
    if is_batched(fn) and isinstance(sample, list):
        return call_batch(fn, sample)
    out = fn(sample)
    if inspect.isawaitable(out):
        out = asyncio.run(_await(out))
    return unpack(out)


def call_batch(fn: Any, samples: list[Any]) -> list[Any]:
    """A batched reward's results on `samples`, one per sample; a wrong count raises for them all."""
    out = fn.score_batch(samples)
    if inspect.isawaitable(out):
        out = asyncio.run(_await(out))
    out = list(out)
    if len(out) != len(samples):
        raise ValueError(f"the reward returned {len(out)} rewards for {len(samples)} completions (one per "
                         "completion expected)")
    results: list[Any] = []
    for r in out:
        if r is None:
            results.append(NoScore("the reward returned None: it cannot score this sample"))
            continue
        try:
            results.append(unpack(r))
        except Exception as e:  # noqa: BLE001 - a non-finite or malformed value fails its sample only
            results.append(e)
    return results


async def _await(x):
    return await x


# ------------------------------------------------------------------------------------------------- threads
class _Thread(threading.Thread):
    def __init__(self, pool: "ThreadWorkers"):
        super().__init__(name=f"glmlight-reward-{next(_names)}", daemon=True)
        self.pool = pool
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.abandoned = False

    def run(self) -> None:
        while True:
            try:
                task = self.inbox.get(timeout=IDLE_EXIT_S)
            except queue.Empty:
                if self.pool._retire(self):
                    return
                continue
            if task is None:
                return
            fut, fn, arg = task
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(arg))
                except BaseException as e:  # noqa: BLE001 - handed to the caller
                    fut.set_exception(e)
            del task, fut, arg
            if not self.pool._release(self):
                return


class ThreadWorkers:
    """Daemon threads for synchronous calls; the caller bounds how many run at once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: list[_Thread] = []
        self._busy: set[_Thread] = set()
        self._abandoned: set[_Thread] = set()
        self._closed = False

    def submit(self, fn: Callable[[Any], Any], arg: Any) -> tuple[concurrent.futures.Future, _Thread]:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            self._closed = False
            worker = self._idle.pop() if self._idle else None
            start = worker is None
            if start:
                worker = _Thread(self)
            self._busy.add(worker)
            worker.inbox.put((fut, fn, arg))
        if start:
            worker.start()
        return fut, worker

    def abandon(self, worker: _Thread) -> None:
        """The call running on `worker` timed out: take the thread out of the pool."""
        with self._lock:
            if worker in self._busy:
                self._busy.discard(worker)
                worker.abandoned = True
                self._abandoned.add(worker)

    @property
    def abandoned(self) -> int:
        """Threads still running a call that timed out."""
        with self._lock:
            return len(self._abandoned)

    def threads(self) -> list[threading.Thread]:
        with self._lock:
            return [*self._idle, *self._busy, *self._abandoned]

    def close(self) -> None:
        """Idle threads exit now; busy ones when their call returns (until the next submit)."""
        with self._lock:
            self._closed = True
            for w in self._idle:
                w.inbox.put(None)
            self._idle.clear()

    def _release(self, worker: _Thread) -> bool:
        with self._lock:
            if worker.abandoned:
                self._abandoned.discard(worker)
                return False
            self._busy.discard(worker)
            if self._closed:
                return False
            self._idle.append(worker)
            return True

    def _retire(self, worker: _Thread) -> bool:
        with self._lock:
            if worker in self._idle and worker.inbox.empty():
                self._idle.remove(worker)
                return True
            return False


# ----------------------------------------------------------------------------------------------- processes
def _process_main(conn: Any, payload: bytes, environ: dict[str, str]) -> None:
    """A worker process: take the parent's environment of the moment it was started (not the fork server's),
    load the reward once, then answer one sample at a time."""
    os.environ.clear()
    os.environ.update(environ)
    os.setpgid(0, 0)  # its own process group: a timeout kills whatever it started too; Ctrl-C is the parent's
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except Exception:  # noqa: BLE001 - best effort; the pipe's EOF ends an idle worker anyway
            pass
    try:
        fn = pickle.loads(payload)
    except BaseException as e:  # noqa: BLE001
        conn.send(("fatal", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", None))
    while True:
        try:
            sample = conn.recv()
        except (EOFError, OSError):
            return
        if sample is None:
            return
        try:
            reply = ("ok", call_reward(fn, sample))
        except BaseException as e:  # noqa: BLE001 - any reward crash goes back to the parent
            reply = ("error", (f"{type(e).__name__}: {e}", "".join(traceback.format_exception(e))))
        try:
            conn.send(reply)
        except Exception as e:  # noqa: BLE001 - e.g. an info dict that cannot be pickled
            conn.send(("error", (f"the reward's result cannot be sent back ({type(e).__name__}: {e})", "")))


class _Process:
    def __init__(self, ctx: Any, payload: bytes):
        self.conn, child = ctx.Pipe(duplex=True)
        # the parent's environment as it is now: a fork server started earlier holds the environment of then
        self.proc = ctx.Process(target=_process_main, args=(child, payload, dict(os.environ)), daemon=True,
                                name=f"glmlight-reward-{next(_names)}")
        self.proc.start()
        child.close()
        self.ready = False

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError, OSError):
            self.proc.kill()
        self.proc.join(5)
        self.conn.close()


class WorkerDied(RuntimeError):
    pass


class ProcessWorkers:
    """Up to `size` worker processes holding the reward `fn` (which must pickle)."""

    def __init__(self, fn: Callable[[Any], Any], size: int):
        self.payload = pickle.dumps(fn)
        # Imported once in the fork server (if this starts it), so that a new worker starts in milliseconds.
        self.preload = ["glmlight.rewards.workers", "glmlight.sample"]
        module = getattr(fn, "__module__", None) or getattr(getattr(fn, "func", None), "__module__", None)
        if module and module != "__main__":
            self.preload.append(module)
        self.size = size
        self._idle: list[_Process] = []
        self._all: set[_Process] = set()
        self._lock = threading.Lock()

    async def call(self, sample: Any, timeout_s: float, mark_started: Callable[[], None] = lambda: None
                   ) -> tuple[float, dict[str, Any]]:
        """Score one sample in a worker; asyncio.TimeoutError after `timeout_s` (the worker is killed).
        The clock starts once a worker is ready (`mark_started` is called then)."""
        worker = await self._acquire()
        mark_started()
        try:
            worker.conn.send(sample)
            kind, value = await asyncio.wait_for(_recv(worker), timeout_s)
        except BaseException:
            self._discard(worker)
            raise
        with self._lock:
            self._idle.append(worker)
        if kind == "error":
            message, remote_traceback = value if isinstance(value, tuple) else (value, "")
            raise RemoteRewardError(message, remote_traceback)
        return value

    def pids(self) -> list[int]:
        with self._lock:
            return [w.proc.pid for w in self._all]

    def close(self) -> None:
        with self._lock:
            workers, self._all, self._idle = list(self._all), set(), []
        for w in workers:
            w.kill()

    async def _acquire(self) -> _Process:
        with self._lock:
            if self._idle:
                return self._idle.pop()
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(self.preload)
        worker = _Process(ctx, self.payload)
        with self._lock:
            self._all.add(worker)
        try:
            kind, value = await asyncio.wait_for(_recv(worker), PROCESS_START_TIMEOUT_S)
        except BaseException as e:
            self._discard(worker)
            if isinstance(e, (asyncio.TimeoutError, WorkerDied)):
                raise RewardError(f"a reward worker process did not start ({type(e).__name__}: {e})") from None
            raise
        if kind == "fatal":
            self._discard(worker)
            raise RewardError(f"task.reward_options.executor=process: a worker process cannot load the reward "
                              f"({value}); it must be importable in a fresh Python process")
        return worker

    def _discard(self, worker: _Process) -> None:
        with self._lock:
            self._all.discard(worker)
        worker.kill()


async def _recv(worker: _Process) -> tuple[str, Any]:
    """The worker's next message, without blocking the event loop."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()
    fd = worker.conn.fileno()

    def readable() -> None:
        loop.remove_reader(fd)
        if fut.done():
            return
        try:
            fut.set_result(worker.conn.recv())
        except (EOFError, OSError):
            worker.proc.join(1)
            fut.set_exception(WorkerDied(f"the reward worker process died (exit code {worker.proc.exitcode})"))

    loop.add_reader(fd, readable)
    try:
        return await fut
    finally:
        loop.remove_reader(fd)
