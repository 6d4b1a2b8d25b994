"""AsyncProducer: rollout in a background thread while training runs (`rollout.mode=async`).

The producer draws a batch of prompts, generates and scores it (`generate`), and hands the
finished groups to the trainer through a bounded queue. Staleness is bounded twice: a batch
starts only when at most `queue_size - 1` others wait untrained (so with queue_size=1 a batch is
generated from the weights the trainer had when it took the batch before, and is one version
old when trained), and the policy-version gate drops what is still too old.

Accounting: what the producer produces and drops goes into `totals` at once; its other counts
(tokens, seconds, turns) are handed to the training batch that takes the batch's first group
(`take_counts`; a batch that yielded no group goes with the next one that did), so which step logs
them does not depend on how far the producer had got. Groups produced and never trained on are
counted as `dropped/shutdown` when the producer stops.

`settle()` (trainer.deterministic=true, before a weight push): wait until the producer has started
every batch its free slots allow, so whether a batch was begun before or after a weight update is
fixed by how many groups training has taken, never by thread timing (docs/reliability.md,
"Repeatable runs").
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter, deque
from typing import Callable

from glmlight.prompt import Prompt
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
        self._slots_cv = threading.Condition()
        self._free = ahead  # group slots free (under _slots_cv)
        self._drawing = False  # slots taken for a batch whose prompts are not drawn yet
        self._stop = threading.Event()
        # per generated batch, in order: [index of its first group among all groups queued, its counts,
        # its number of groups]; handed to training by `take_counts`
        self._batch_counts: deque[list] = deque()
        self._queued_groups = 0  # groups put in the queue, all batches
        self._taken_groups = 0  # groups training took
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
        with self.stream.lock:
            self._taken_groups += 1
        self._release(1)
        return group

    def take_counts(self) -> Counter:
        """The per-batch counts (tokens, seconds, agent turns...) of every generated batch whose first group
        training has taken and that was not handed out before (with any batch before it that yielded no group)."""
        out: Counter = Counter()
        with self.stream.lock:
            while self._batch_counts:
                first, _, n = self._batch_counts[0]
                if n and first >= self._taken_groups:
                    break
                if not n:  # no group: goes with the next batch that has one, once that one is taken
                    later = next((b for b in self._batch_counts if b[2]), None)
                    if later is None or later[0] >= self._taken_groups:
                        break
                out.update(self._batch_counts.popleft()[1])
        return out

    def pending_counts(self) -> Counter:
        """The per-batch counts not taken yet (for a checkpoint: they belong to the queued groups)."""
        out: Counter = Counter()
        with self.stream.lock:
            for _, counts, _ in self._batch_counts:
                out.update(counts)
        return out

    def settle(self, timeout: float | None = None) -> None:
        """Wait until the producer cannot start another batch without more free slots: every batch it may
        start now has drawn its prompts (and holds the generation lock, or is done). Returns at once when
        the producer has stopped or failed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._slots_cv:
            while not (self._stop.is_set() or not self.alive or self.error is not None
                       or (not self._drawing and self._free < self.batch_prompts)):
                if deadline is not None and time.monotonic() > deadline:
                    return
                self._slots_cv.wait(0.1)

    def queued(self) -> list[list[Sample]]:
        """The finished groups waiting in the queue (for a checkpoint)."""
        return list(self._queue.queue)

    def stop(self) -> None:
        """Stop the thread; what it produced and nobody took is counted as dropped/shutdown."""
        self._stop.set()
        with self._slots_cv:
            self._slots_cv.notify_all()
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
                # generate() takes the data module's generation lock first thing; `settle` returns once the
                # prompts are drawn, so a deterministic weight push that follows waits for this batch
                samples = self.generate(prompts, counts, self._drawn)
                by_group: dict[int, list[Sample]] = {}
                for smp in samples:
                    by_group.setdefault(smp.group_id, []).append(smp)
                pending = list(by_group.values())
                with self.stream.lock:
                    self.inflight_cursor = None
                    self.totals.update({k: v for k, v in counts.items() if k.startswith(_LIFETIME)})
                    self._batch_counts.append([self._queued_groups, Counter(
                        {k: v for k, v in counts.items() if not k.startswith(_LIFETIME)}), len(pending)])
                    self._queued_groups += len(pending)
                self._release(max(0, taken - len(pending)))  # fewer groups than slots taken
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
        """Take n group slots (0 when stopped first); the batch is then drawing until `_drawn`."""
        with self._slots_cv:
            while self._free < n:
                if self._stop.is_set():
                    return 0
                self._slots_cv.wait(0.1)
            self._free -= n
            self._drawing = True
            return n

    def _drawn(self) -> None:
        """The batch's prompts are drawn and the generation lock is held: `settle` may return."""
        with self._slots_cv:
            self._drawing = False
            self._slots_cv.notify_all()

    def _release(self, n: int) -> None:
        if n:
            with self._slots_cv:
                self._free += n
                self._slots_cv.notify_all()

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
