"""The reward protocol: a sample in, a float (and an info dict) out; sync or async.

A reward function that raises marks its sample FAILED; the failure is counted
and logged and never stops the run. A non-finite reward is a failure too.

`RewardRunner` scores a batch under `RewardOptions` (`task.reward_options`): every
sample's call has `timeout_s` seconds, at most `max_concurrency` calls run at once.
Synchronous rewards run in worker threads (`executor="thread"`) or worker processes
(`executor="process"`, glmlight/rewards/workers.py); async rewards run on an event loop
of their own. A call past its timeout fails its sample with metadata["reward_timeout"]
and is cancelled (async), abandoned (a thread: Python cannot stop one) or killed (a
process). Hung threads are bounded: when `max_concurrency` of them are still running,
the run stops with one line instead of leaking more.

A batched reward (TRL-style, glmlight/rewards/styles.py) is called once per prompt group (the samples
that share a group id), the group's call under the same `timeout_s`; a call that raises fails its group.

A reward that raises is logged once with its traceback (the first failure of each exception type);
later failures are only counted (`rollout/reward_failed`, the sample's metadata["reward_error"]).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import inspect
import logging
import threading
import time
import traceback
from collections import Counter
from collections.abc import Mapping
from typing import Any, Awaitable, Callable, Union

from glmlight.config.rules import check_section
from glmlight.config.rollout import RewardOptions
from glmlight.errors import ConfigError
from glmlight.rewards.workers import (NoScore, ProcessWorkers, RemoteRewardError, RewardError, ThreadWorkers,
                                      call_reward, is_batched, unpack)
from glmlight.sample import Sample, Status

log = logging.getLogger(__name__)

RewardOutput = Union[float, tuple[float, dict[str, Any]]]
RewardFn = Callable[[Sample], Union[RewardOutput, Awaitable[RewardOutput]]]
_unpack = unpack
_PENDING = object()
WATCHDOG_GRACE_S = 5.0  # past timeout_s + this, an unfinished call means its event loop is blocked


class RewardTimeout(Exception):
    """A sample's reward call ran past task.reward_options.timeout_s."""


def _is_async(fn: Any) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


def reward_options(options: RewardOptions | Mapping[str, Any] | None) -> RewardOptions:
    """`options` as a checked RewardOptions (a config node or dict is accepted)."""
    if options is None:
        return RewardOptions()
    if not isinstance(options, RewardOptions):
        try:
            options = RewardOptions(**dict(options))
        except TypeError as e:
            raise ConfigError(f"config error: task.reward_options: {e}") from None
    check_section(options, "task.reward_options")  # the ranges and allowed values declared on its fields
    if not isinstance(options.max_concurrency, int):
        raise ConfigError(f"config error: task.reward_options.max_concurrency must be >= 1, got "
                          f"{options.max_concurrency!r}")
    return options


class RewardRunner:
    """Scores batches of samples with the reward `fn` under `options`; callable on one sample as `fn` is."""

    def __init__(self, fn: RewardFn, options: RewardOptions | Mapping[str, Any] | None = None):
        if isinstance(fn, RewardRunner):
            fn = fn.fn
        if not callable(fn):
            raise ConfigError(f"config error: task.reward is not callable ({type(fn).__name__})")
        self.fn, self.options = fn, reward_options(options)
        self.is_async = _is_async(fn) and not is_batched(fn)
        self._logged: set[str] = set()  # exception types whose traceback was logged (once each)
        self._threads = ThreadWorkers()
        self._stuck_loops: list[threading.Thread] = []
        self._procs: ProcessWorkers | None = None
        if self.options.executor == "process":
            try:
                self._procs = ProcessWorkers(fn, self.options.max_concurrency)
            except Exception as e:  # noqa: BLE001 - pickling can fail in many ways
                raise ConfigError(f"config error: task.reward_options.executor=process: the reward "
                                  f"({type(fn).__name__}) cannot be sent to a worker process ({type(e).__name__}: "
                                  f"{e}); use executor=thread") from None

    def __call__(self, sample: Sample) -> Any:
        return self.fn(sample)

    @property
    def hung(self) -> int:
        """Reward calls past their timeout that are still running (threads cannot be stopped)."""
        self._stuck_loops = [t for t in self._stuck_loops if t.is_alive()]
        return self._threads.abandoned + len(self._stuck_loops)

    def threads(self) -> list[threading.Thread]:
        return self._threads.threads() + [t for t in self._stuck_loops if t.is_alive()]

    def pids(self) -> list[int]:
        return self._procs.pids() if self._procs is not None else []

    def close(self) -> None:
        self._threads.close()
        if self._procs is not None:
            self._procs.close()

    # ------------------------------------------------------------------------------------------ scoring
    def score(self, samples: list[Sample]) -> Counter:
        """Set `sample.reward` for each sample not already FAILED. Returns counts: "scored", "failed"
        (the reward raised or returned a non-finite value) and "timeout"."""
        counts: Counter = Counter()
        todo = [s for s in samples if s.status is not Status.FAILED]
        if not todo:
            return counts
        hung = self.hung
        if hung >= self.options.max_concurrency:
            raise RewardError(
                f"the reward hangs: {hung} calls are still running past task.reward_options.timeout_s="
                f"{self.options.timeout_s:g}, and threads cannot be stopped; fix the reward, or set "
                "task.reward_options.executor=process (hung calls are killed)")
        results = self._run_batch(todo)
        for s, r in zip(todo, results):
            if isinstance(r, RewardTimeout):
                s.status, s.reward = Status.FAILED, None
                s.metadata["reward_error"] = str(r)
                s.metadata["reward_timeout"] = True
                counts["timeout"] += 1
            elif isinstance(r, BaseException):
                s.status, s.reward = Status.FAILED, None
                s.metadata["reward_error"] = _describe(r)
                counts["failed"] += 1
                self._log_failure(s, r)
            else:
                s.reward, info = r
                s.metadata.setdefault("reward_info", {}).update(info)
                counts["scored"] += 1
        if counts["failed"]:
            log.debug("reward failed on %d of %d samples (counted in rollout/reward_failed)", counts["failed"],
                      len(todo))
        if counts["timeout"]:
            log.warning("reward timed out on %d of %d samples (task.reward_options.timeout_s=%g); counted as "
                        "dropped/reward_timeout", counts["timeout"], len(todo), self.options.timeout_s)
        return counts

    def _log_failure(self, sample: Sample, error: BaseException) -> None:
        """The first failure of each kind, with its traceback; the rest are counted, not logged."""
        kind = type(error).__name__ if not isinstance(error, RemoteRewardError) else str(error).split(":")[0]
        if kind in self._logged:
            return
        self._logged.add(kind)
        if isinstance(error, NoScore):
            log.warning("the reward returned None for rollout %s (it cannot score it): such samples are not trained "
                        "on; they are counted in rollout/reward_failed and not logged again", sample.rollout_id)
            return
        if isinstance(error, RemoteRewardError):
            trace = error.remote_traceback or f"{error}\n"
        else:
            trace = "".join(traceback.format_exception(error))
        log.error("the reward failed on rollout %s (its sample is not trained on); this is logged once, later "
                  "failures are counted in rollout/reward_failed and the samples' reward_error:\n%s",
                  sample.rollout_id, trace.rstrip())

    def _run_batch(self, todo: list[Sample]) -> list[Any]:
        """Run the batch on an event loop in its own thread; watch that the loop keeps its timeouts."""
        results: list[Any] = [_PENDING] * len(todo)
        started: dict[int, float] = {}
        done: concurrent.futures.Future = concurrent.futures.Future()

        def loop_main() -> None:
            try:
                asyncio.run(self._score_all(todo, results, started))
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller
                done.set_exception(e)
            else:
                done.set_result(None)

        thread = threading.Thread(target=loop_main, name="glmlight-reward-loop", daemon=True)
        thread.start()
        limit = self.options.timeout_s + WATCHDOG_GRACE_S
        while True:
            try:
                done.result(timeout=0.2)
                break
            except concurrent.futures.TimeoutError:
                now = time.monotonic()
                if any(results[i] is _PENDING and now - t > limit for i, t in list(started.items())):
                    # The loop cannot fire its timeouts: an async reward blocks it (synchronous work inside
                    # `async def`) or ignores cancellation. Give up on what is left; the thread is abandoned.
                    self._stuck_loops.append(thread)
                    log.error("the async reward blocks its event loop (synchronous work inside `async def`?); "
                              "%d unfinished samples fail as reward timeouts", results.count(_PENDING))
                    break
        blocked = f"timed out: the reward's event loop was blocked for over {limit:g}s"
        return [RewardTimeout(blocked) if r is _PENDING else r for r in list(results)]

    async def _score_all(self, todo: list[Sample], results: list[Any], started: dict[int, float]) -> None:
        sem = asyncio.Semaphore(self.options.max_concurrency)

        async def one(i: int, sample: Sample) -> None:
            async with sem:
                try:
                    results[i] = await self._call(sample, lambda: started.__setitem__(i, time.monotonic()))
                except asyncio.TimeoutError:
                    results[i] = RewardTimeout(f"timed out after {self.options.timeout_s:g}s "
                                               "(task.reward_options.timeout_s)")
                except RewardError:
                    raise
                except Exception as e:  # noqa: BLE001 - any reward crash is a counted failure
                    results[i] = e

        async def group(idx: list[int]) -> None:
            async with sem:
                mark = lambda: [started.__setitem__(i, time.monotonic()) for i in idx]  # noqa: E731
                try:
                    out = await self._call([todo[i] for i in idx], mark)
                except asyncio.TimeoutError:
                    out = [RewardTimeout(f"timed out after {self.options.timeout_s:g}s (task.reward_options."
                                         "timeout_s; the group's one call)")] * len(idx)
                except RewardError:
                    raise
                except Exception as e:  # noqa: BLE001 - the call failed: its whole group fails
                    out = [e] * len(idx)
                for i, r in zip(idx, out):
                    results[i] = r

        if is_batched(self.fn):
            groups: dict[int, list[int]] = {}
            for i, s in enumerate(todo):
                groups.setdefault(s.group_id, []).append(i)
            await asyncio.gather(*(group(idx) for idx in groups.values()))
        else:
            await asyncio.gather(*(one(i, s) for i, s in enumerate(todo)))

    async def _call(self, sample: Sample | list[Sample], mark_started: Callable[[], Any]) -> Any:
        timeout = self.options.timeout_s
        if self._procs is not None:
            return await self._procs.call(sample, timeout, mark_started)
        mark_started()
        if self.is_async:
            return await asyncio.wait_for(_acall(self.fn, sample), timeout)
        fut, worker = self._threads.submit(functools.partial(call_reward, self.fn), sample)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(fut), timeout)
        except asyncio.TimeoutError:
            self._threads.abandon(worker)
            raise


def _describe(error: BaseException) -> str:
    """A failure as the sample's reward_error: "Type: message" (a worker process's error as it was raised)."""
    return str(error) if isinstance(error, RemoteRewardError) else f"{type(error).__name__}: {error}"


async def _acall(fn: RewardFn, sample: Sample) -> tuple[float, dict[str, Any]]:
    out = fn(sample)
    if inspect.isawaitable(out):
        out = await out
    return unpack(out)


def score_samples(fn: RewardFn, samples: list[Sample], options: RewardOptions | Mapping[str, Any] | None = None
                  ) -> Counter:
    """Set `sample.reward` for each sample (concurrently, each call under a timeout; see RewardRunner).

    Returns counts: "scored", "failed" and "timeout". A failing sample gets status FAILED,
    reward None and metadata["reward_error"] (and metadata["reward_timeout"] when it timed out).
    `fn` may be a RewardRunner (its options apply) or any reward (`options`, default RewardOptions()).
    """
    if isinstance(fn, RewardRunner) and options is None:
        return fn.score(samples)
    runner = RewardRunner(fn, options)
    try:
        return runner.score(samples)
    finally:
        runner.close()


def _run(coro):
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    # Called from inside a running loop (e.g. an async producer): run in a fresh thread's loop.
    with concurrent.futures.ThreadPoolExecutor(1) as ex:
        return ex.submit(asyncio.run, coro).result()
