"""The decode thread of `LocalEngine` (a mixin, glmlight/engines/local/engine.py): each iteration
steps the running rows (or, with speculative decoding, runs a speculative round over them:
speculation.py), admits queued requests into the batch (their prompts prefilled), samples,
and retires the rows that finished; it exits after `IDLE_EXIT_S` idle (the next submit starts
another). Also what ends every request at once (`_abort_locked`)."""

from __future__ import annotations

from typing import Any, Callable

import logging
import threading
import time
from collections import deque

import torch

from glmlight.engines.base import Generation
from glmlight.engines.local.batch import Request, RunningBatch, fill_holes, resolve_requests

log = logging.getLogger("glmlight.engines.local.engine")

IDLE_EXIT_S = 2.0  # an idle decode thread exits after this long; the next submit starts another


class DecodeLoop:
    """The decode thread of LocalEngine (glmlight/engines/local/engine.py); what it reads from the engine is
    declared below."""

    # read from the class this is part of, defined there
    model: torch.nn.Module
    device: torch.device
    filter_order: str
    num_threads: int | None
    share_prefill: bool
    max_batch_size: int
    on_step: Callable[..., Any] | None
    _runner: Any
    _spec: Any  # speculation.Speculation, or None
    _version: int
    _stats: Any
    _capture: Any
    _capture_since: Any
    _closed: bool
    _turn: threading.Lock
    _lock: threading.Lock
    _cv: threading.Condition

    def _attach_records(self, done: list[tuple[Request, Generation]], rows: list[int]) -> None:
        """Replay records of finished rows (requests admitted while capturing; aborts get none)."""
        for (req, gen), row in zip(done, rows):
            if req.first_iteration >= self._capture_since and gen.finish_reason != "abort":
                gen.routed_experts, gen.indexer_topk = self._runner.records(row)

    def _loop(self) -> None:
        if self.num_threads and self.device.type == "cpu":
            torch.set_num_threads(self.num_threads)  # per thread: the caller keeps its own
        idle_since = time.monotonic()
        while True:
            with self._cv:
                while not self._pending and not len(self._batch) and not self._closed:
                    if time.monotonic() - idle_since > IDLE_EXIT_S or not threading.main_thread().is_alive():
                        self._thread = None  # a later submit starts a new one
                        return
                    self._cv.wait(0.1)
                if self._closed:
                    return
            try:
                done = self._step()
            except BaseException as e:  # fail what was in flight, keep serving
                with self._lock:
                    done = [(r, e) for r in self._batch.requests + self._admitting]
                    self._admitting = []
                    self._batch = RunningBatch(self.device, self.filter_order, self._spec is not None)
                    self._batch.mark_version(self._iteration, self._version)
                    if self._runner is not None:
                        self._runner.reset()
                if not isinstance(e, Exception):  # interpreter shutdown and the like: stop here
                    resolve_requests(done)
                    with self._cv:
                        self._thread = None
                    raise
            resolve_requests(done)
            idle_since = time.monotonic()
            hook = self.on_step
            if hook is not None:
                try:
                    hook(self._iteration)
                except Exception:  # a monitoring hook must not stop the engine
                    log.exception("LocalEngine.on_step hook failed")

    def _take_pending(self) -> list[Request]:
        with self._cv:
            room = self.max_batch_size - len(self._batch)
            if len(self._batch) and not self._runner.can_merge:
                room = 0
            take = [self._pending.popleft() for _ in range(min(room, len(self._pending)))]
            self._stats["admitted"] += len(take)
            self._stats["admitted_mid_decode"] += len(take) if len(self._batch) else 0
            return take

    def _step(self) -> list[tuple[Request, Generation]]:
        """One decode iteration: step the running rows, admit newcomers, sample, retire finished rows."""
        with self._turn:  # let a waiting weight update (or abort, score, close) go first
            pass
        with self._lock, torch.inference_mode():
            if self.model is None:
                return []
            batch, runner, spec = self._batch, self._runner, self._spec
            self._admitting = self._take_pending()
            running = len(batch)
            speculate = bool(running) and spec is not None and spec.choose()
            spec_on = spec is not None and spec.on  # (before this round's measurement may turn it off or on)
            # (tokens, log-probs) of the running rows (sampled inside a compiled step), then of newcomers
            sampled, spec_done = [], None
            if speculate:  # several tokens per running row (speculation.py)
                tok, lp, accepted = spec.round(runner, batch)
                spec_done, recorded = batch.record_many(tok, lp, accepted + 1, self._iteration)
                runner.advance(recorded)
                self._count_speculation(running, spec_on, recorded, accepted)
            elif running:
                t0 = time.perf_counter() if spec is not None else 0.0
                sampled = [runner.step(batch.last, batch.sampler())]
                if spec is not None:
                    spec.note_plain(time.perf_counter() - t0)
                    self._count_speculation(running, spec_on, None, None)
            shared_prefills = 0
            if self._admitting:
                prompts = [r.prompt for r in self._admitting]
                # the fast runners prefill a prompt once for all its copies (the generic runner, each)
                shared = self.share_prefill and hasattr(runner, "admit_shared")
                logits = runner.admit_shared(prompts) if shared else runner.admit(prompts)
                shared_prefills = len(prompts) - len({tuple(p) for p in prompts}) if shared else 0
                batch.add(self._admitting, self._iteration)
                self._admitting = []
                sampled.append(batch.sampler(running)(logits))
            if spec_done is not None:
                finished = spec_done
                if sampled:  # newcomers: their first token
                    tok, lp = sampled[0]
                    new_done, _ = batch.record_many(tok[:, None], lp[:, None], torch.ones_like(tok), self._iteration,
                                                    lo=running)
                    finished = torch.cat([spec_done, new_done])
            elif not sampled:
                return []
            else:
                finished = batch.record(*(sampled[0] if len(sampled) == 1 else map(torch.cat, zip(*sampled))),
                                        iteration=self._iteration)
            self._iteration += 1
            n = len(batch)
            rows = finished.nonzero()[:, 0].tolist()
            done = batch.finish(rows)
            if self._capture != (False, False):
                self._attach_records(done, rows)
            if rows:
                order = fill_holes(n, rows)
                batch.keep(order)
                runner.keep(order)
            with self._cv:
                s = self._stats
                s["iterations"] += 1
                s["decode_steps"] += running > 0
                s["prefills"] += n > running
                s["shared_prefills"] += shared_prefills
                s["max_batch"] = max(s["max_batch"], n)
                s["tokens"] += n if spec_done is None else n - running + int(recorded.sum())
            return done

    def _count_speculation(self, running: int, on: bool, recorded: torch.Tensor | None,
                           accepted: torch.Tensor | None) -> None:
        """The speculation counters of `stats` after a decode round of `running` rows (plain: recorded None),
        `on`: whether speculation was on when the round was chosen."""
        with self._cv:
            s = self._stats
            s["spec_decode_rounds"] += 1
            s["spec_on_rounds"] += int(on)
            s["spec_row_forwards"] += running
            s["spec_decode_tokens"] += running if recorded is None else int(recorded.sum())
            if accepted is not None:
                s["spec_drafted"] += running * self._spec.depth
                s["spec_accepted"] += int(accepted.sum())

    def _abort_locked(self) -> list[tuple[Request, Generation]]:
        """End all queued and running requests with "abort" (caller holds the lock)."""
        with self._cv:
            pending, self._pending = list(self._pending), deque()
        done = [(r, Generation([], [], "abort", [])) for r in pending]
        with torch.inference_mode():
            done += self._batch.finish(list(range(len(self._batch))), reason="abort")
            self._batch.keep([])
        if self._runner is not None:
            self._runner.reset()
        with self._cv:
            self._stats["aborted"] += len(done)
        return done
