"""AsyncProducer: rollout in a background thread while training runs (`rollout.mode=async`).

The producer draws a batch of prompts, generates and scores it (`generate`), and hands the
finished groups to the trainer through a bounded queue. Staleness is bounded twice: a batch
starts only when at most `queue_size - 1` others wait untrained (so with queue_size=1 a batch is
generated from the weights the trainer had when it took the batch before, and is one version
old when trained), and the policy-version gate drops what is still too old.

Accounting: what the producer produces and drops goes into `totals` at once; its other counts
(tokens, seconds, turns) are handed to the next training batch (`take_counts`). Groups produced
and never trained on are counted as `dropped/shutdown` when the producer stops.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import Counter
from typing import Callable

from glmlight.data.sources import Prompt
from glmlight.data.stream import PromptStream
from glmlight.sample import Sample

log = logging.getLogger(__name__)

_LIFETIME = ("produced", "dropped/")


class AsyncProducer:
    def __init__(self, stream: PromptStream, generate: Callable[[list[Prompt], Counter], list[Sample]],
                 batch_prompts: int, queue_size: int, totals: Counter):
        self.stream, self.generate, self.batch_prompts = stream, generate, batch_prompts
        self.totals = totals
        ahead = queue_size * batch_prompts  # group slots: generated or being generated, not yet taken
        self._queue: queue.Queue[list[Sample]] = queue.Queue(maxsize=ahead)
        self._slots = threading.Semaphore(ahead)
        self._stop = threading.Event()
        self._counts: Counter = Counter()
        self.error: BaseException | None = None
        self.inflight_cursor: int | None = None  # where the prompts being generated now were drawn
        self._thread = threading.Thread(target=self._run, name="glmlight-rollout-producer", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def get(self, timeout: float = 0.5) -> list[Sample] | None:
        """The next finished group, or None after `timeout`; raises if the producer failed or stopped."""
        try:
            group = self._queue.get(timeout=timeout)
        except queue.Empty:
            if self.error is not None:
                raise RuntimeError("the rollout producer failed") from self.error
            if not self.alive:
                raise RuntimeError("the rollout producer stopped")
            return None
        self._slots.release()
        return group

    def take_counts(self) -> Counter:
        """The producer's per-batch counts since the last call (tokens, seconds, agent turns...)."""
        with self.stream.lock:
            out, self._counts = self._counts, Counter()
        return out

    def pending_counts(self) -> Counter:
        """The per-batch counts not taken yet (for a checkpoint: they belong to the queued groups)."""
        with self.stream.lock:
            return Counter(self._counts)

    def queued(self) -> list[list[Sample]]:
        """The finished groups waiting in the queue (for a checkpoint)."""
        return list(self._queue.queue)

    def stop(self) -> None:
        """Stop the thread; what it produced and nobody took is counted as dropped/shutdown."""
        self._stop.set()
        leftovers: list[list[Sample]] = []
        while self._thread.is_alive():
            leftovers.extend(self._drain())
            self._thread.join(timeout=0.1)
        leftovers.extend(self._drain())
        self._count_shutdown(leftovers)

    # ----------------------------------------------------------------- the thread
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                taken = self._take_slots(self.batch_prompts)
                if taken < self.batch_prompts:
                    break  # stopping
                counts: Counter = Counter()
                with self.stream.lock:
                    self.inflight_cursor = self.stream.cursor
                    prompts = self.stream.draw(self.batch_prompts)
                samples = self.generate(prompts, counts)
                with self.stream.lock:
                    self.inflight_cursor = None
                    self.totals.update({k: v for k, v in counts.items() if k.startswith(_LIFETIME)})
                    self._counts.update({k: v for k, v in counts.items() if not k.startswith(_LIFETIME)})
                by_group: dict[int, list[Sample]] = {}
                for smp in samples:
                    by_group.setdefault(smp.group_id, []).append(smp)
                pending = list(by_group.values())
                for _ in range(max(0, taken - len(pending))):  # fewer groups than slots taken
                    self._slots.release()
                while pending and not self._stop.is_set():
                    try:
                        self._queue.put(pending[0], timeout=0.1)
                        pending.pop(0)
                    except queue.Full:
                        continue
                self._count_shutdown(pending)
        except BaseException as e:  # noqa: BLE001 - handed to the training thread
            self.error = e
            log.error("rollout producer failed: %s: %s", type(e).__name__, e)

    def _take_slots(self, n: int) -> int:
        """Acquire up to n group slots, giving up when stopped; returns how many."""
        taken = 0
        while taken < n and not self._stop.is_set():
            if self._slots.acquire(timeout=0.1):
                taken += 1
        return taken

    def _count_shutdown(self, groups: list[list[Sample]]) -> None:
        n = sum(len(g) for g in groups)
        if n:
            with self.stream.lock:
                self.totals["dropped/shutdown"] += n

    def _drain(self) -> list[list[Sample]]:
        out = []
        while True:
            try:
                out.append(self._queue.get_nowait())
            except queue.Empty:
                return out
