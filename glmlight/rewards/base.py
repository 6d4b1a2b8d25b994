"""The reward protocol: a sample in, a float (and an info dict) out; sync or async.

A reward function that raises marks its sample FAILED; the failure is counted
and logged and never stops the run. A non-finite reward is a failure too.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
from collections import Counter
from typing import Any, Awaitable, Callable, Union

from glmlight.sample import Sample, Status

log = logging.getLogger(__name__)

RewardOutput = Union[float, tuple[float, dict[str, Any]]]
RewardFn = Callable[[Sample], Union[RewardOutput, Awaitable[RewardOutput]]]


def _unpack(out: RewardOutput) -> tuple[float, dict[str, Any]]:
    if isinstance(out, tuple):
        value, info = out
    else:
        value, info = out, {}
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"reward is not finite: {value}")
    return value, dict(info)


async def _score_one(fn: RewardFn, sample: Sample) -> tuple[float, dict[str, Any]]:
    out = fn(sample)
    if inspect.isawaitable(out):
        out = await out
    return _unpack(out)


def score_samples(fn: RewardFn, samples: list[Sample]) -> Counter:
    """Set `sample.reward` for each sample (async rewards run concurrently).

    Returns counts: "scored" and "failed". A failing sample gets status FAILED,
    reward None and metadata["reward_error"].
    """
    counts: Counter = Counter()
    todo = [s for s in samples if s.status is not Status.FAILED]

    async def run_all():
        return await asyncio.gather(*(_score_one(fn, s) for s in todo), return_exceptions=True)

    if inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None)):
        results = _run(run_all())
    else:
        results = []
        for s in todo:
            try:
                out = fn(s)
                results.append(_unpack(_run(_await(out)) if inspect.isawaitable(out) else out))
            except Exception as e:  # noqa: BLE001 - any reward crash is a counted failure
                results.append(e)
    for s, r in zip(todo, results):
        if isinstance(r, BaseException):
            s.status = Status.FAILED
            s.reward = None
            s.metadata["reward_error"] = f"{type(r).__name__}: {r}"
            counts["failed"] += 1
            log.warning("reward failed for rollout %s: %s: %s", s.rollout_id, type(r).__name__, r)
        else:
            s.reward, info = r
            s.metadata.setdefault("reward_info", {}).update(info)
            counts["scored"] += 1
    return counts


async def _await(x):
    return await x


def _run(coro):
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    # Called from inside a running loop (e.g. an async producer): run in a fresh thread's loop.
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(1) as ex:
        return ex.submit(asyncio.run, coro).result()
