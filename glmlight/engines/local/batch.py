"""The running batch of the embedded engine: per-request sampling state, on the device.

One row per request being decoded, in the runner's row order. Per-row settings
live in three small tensors (`floats` [n, 2]: temperature, top-p; `ints` [n, 4]:
top-k, tokens generated, max new tokens, slot; `stops` [n, S]), so a decode step
samples, records and checks every row with a fixed number of tensor ops, and
compaction is one `index_select` each. Sampled tokens and log-probs go straight
into per-slot output buffers and are read back only when a request finishes.

A batch made for speculative decoding (`speculative=True`) also holds each request's two further
uniform streams (`Request.spec_uniforms`: acceptance tests and resampled tokens,
`glmlight.engines.local.speculation`) and the engine iteration of every token (a round emits several),
and records several tokens per row at once (`record_many`).
"""

from __future__ import annotations

from bisect import bisect_right
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial

import torch

from glmlight.engines.base import Generation, SamplingParams
from glmlight.engines.local.sampling import sample_with_uniforms

TOP_K, STEP, MAX_NEW, SLOT = range(4)


@dataclass
class Request:
    prompt: list[int]
    params: SamplingParams
    seed: int
    uniforms: torch.Tensor  # [max_new_tokens] float64, drawn from the request's own seed
    future: Future = field(default_factory=Future)
    first_iteration: int = -1  # engine iteration that sampled the request's first token
    spec_uniforms: torch.Tensor | None = None  # [2, max_new_tokens] float64: speculative decoding's own streams


class RunningBatch:
    def __init__(self, device: torch.device, filter_order: str = "sequential", speculative: bool = False):
        self.device = device
        self.filter_order = filter_order  # how top-k and top-p combine (glmlight/ops/logprobs.py)
        self.speculative = speculative
        self.requests: list[Request] = []
        self.floats = torch.zeros(0, 2, device=device)
        self.ints = torch.zeros(0, 4, dtype=torch.long, device=device)
        self.stops = torch.zeros(0, 0, dtype=torch.long, device=device)
        self.last = torch.zeros(0, dtype=torch.long, device=device)  # last sampled token per row
        self._alloc_slots(16, 16)
        self.free = list(range(16))
        # version marks: (first engine iteration served by a version, version)
        self.marks: list[tuple[int, int]] = [(0, 0)]
        self._summarise()

    def __len__(self) -> int:
        return len(self.requests)

    # ----------------------------------------------------------------- buffers
    def _alloc_slots(self, slots: int, length: int) -> None:
        old = getattr(self, "tokens", None)
        dev = self.device
        tokens = torch.zeros(slots, length, dtype=torch.long, device=dev)
        logps = torch.zeros(slots, length, device=dev)
        uniforms = torch.zeros(slots, length, dtype=torch.float64, device=dev)
        if old is not None:
            s, L = old.shape
            tokens[:s, :L], logps[:s, :L], uniforms[:s, :L] = self.tokens, self.logps, self.uniforms
        self.tokens, self.logps, self.uniforms = tokens, logps, uniforms
        if self.speculative:  # the speculative streams and the iteration of every token
            spec = torch.zeros(2, slots, length, dtype=torch.float64, device=dev)
            iters = torch.zeros(slots, length, dtype=torch.long, device=dev)
            if old is not None:
                spec[:, :s, :L], iters[:s, :L] = self.spec_uniforms, self.iterations
            self.spec_uniforms, self.iterations = spec, iters

    def _take_slots(self, k: int, length: int) -> list[int]:
        slots, L = self.tokens.shape
        if k > len(self.free) or length > L:
            grow = max(k - len(self.free), 0)
            new_slots = max(slots + grow, 2 * slots if grow else slots)
            self._alloc_slots(new_slots, max(L, length if length <= L else max(length, 2 * L)))
            self.free.extend(range(slots, new_slots))
        taken, self.free = self.free[:k], self.free[k:]
        return taken

    # ----------------------------------------------------------------- rows
    def add(self, requests: list[Request], iteration: int) -> None:
        """Append newly admitted requests as rows (after the runner appended their cache rows)."""
        slots = self._take_slots(len(requests), max(r.params.max_new_tokens for r in requests))
        for r, s in zip(requests, slots):
            r.first_iteration = iteration
            self.uniforms[s, : r.params.max_new_tokens] = r.uniforms.to(self.device)
            if self.speculative:
                self.spec_uniforms[:, s, : r.params.max_new_tokens] = r.spec_uniforms.to(self.device)
        dev = self.device
        floats = torch.tensor([[r.params.temperature, r.params.top_p] for r in requests], device=dev)
        ints = torch.tensor([[r.params.top_k, 0, r.params.max_new_tokens, s] for r, s in zip(requests, slots)],
                            dtype=torch.long, device=dev)
        S = max(self.stops.shape[1], max(len(r.params.stop_token_ids) for r in requests))
        stops = torch.full((len(requests), S), -1, dtype=torch.long, device=dev)
        for i, r in enumerate(requests):
            if r.params.stop_token_ids:
                stops[i, : len(r.params.stop_token_ids)] = torch.tensor(r.params.stop_token_ids)
        old_stops = torch.nn.functional.pad(self.stops, (0, S - self.stops.shape[1]), value=-1)
        self.floats = torch.cat([self.floats, floats])
        self.ints = torch.cat([self.ints, ints])
        self.stops = torch.cat([old_stops, stops])
        self.requests.extend(requests)
        self._summarise()

    def _summarise(self) -> None:
        """What the rows ask of the sampler (known on the host: no device sync per step)."""
        reqs = self.requests
        greedy = sum(r.params.temperature == 0 for r in reqs)
        self._greedy = "none" if greedy == 0 else "all" if greedy == len(reqs) else "some"
        self._use_top_k = any(r.params.top_k > 0 for r in reqs)
        self._use_top_p = any(r.params.top_p < 1 for r in reqs)

    def sampler(self, lo: int = 0, hi: int | None = None) -> partial:
        """`sample_with_uniforms` bound to the settings of rows lo..hi-1 and the uniforms of their
        next tokens: a row-wise function of their logits [hi - lo, V] -> (tokens, log-probs)."""
        ints = self.ints[lo:hi]
        return partial(sample_with_uniforms, uniforms=self.uniforms[ints[:, SLOT], ints[:, STEP]],
                       **self.settings(lo, hi))

    def settings(self, lo: int = 0, hi: int | None = None) -> dict:
        """The sampling settings of rows lo..hi-1 as `sample_with_uniforms`' keyword arguments (no uniforms)."""
        ints, floats = self.ints[lo:hi], self.floats[lo:hi]
        return dict(temperature=floats[:, 0], top_k=ints[:, TOP_K], top_p=floats[:, 1], use_top_k=self._use_top_k,
                    use_top_p=self._use_top_p, greedy=self._greedy, order=self.filter_order)

    def record(self, tok: torch.Tensor, lp: torch.Tensor, iteration: int = 0) -> torch.Tensor:
        """Record every row's sampled token and its log-prob and advance the rows; returns the bool
        mask of rows that finished [n]. `iteration`: the engine iteration (kept for a speculative batch)."""
        ints = self.ints
        step, slot = ints[:, STEP], ints[:, SLOT]
        self.tokens[slot, step] = tok
        self.logps[slot, step] = lp.to(self.logps.dtype)
        if self.speculative:
            self.iterations[slot, step] = iteration
        ints[:, STEP] += 1
        done = ints[:, STEP] >= ints[:, MAX_NEW]
        if self.stops.shape[1]:
            done |= (self.stops == tok[:, None]).any(-1)
        self.last = tok
        return done

    def record_many(self, tok: torch.Tensor, lp: torch.Tensor, count: torch.Tensor, iteration: int, lo: int = 0
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Record up to count[i] (>= 1) tokens tok [m, J] with their log-probs lp [m, J] for rows lo..lo+m-1 of a
        speculative batch, each row stopping at its first stop token or its max_new_tokens; returns (the bool mask
        of those rows that finished [m], how many tokens each recorded [m])."""
        ints = self.ints[lo: lo + tok.shape[0]]  # a view: advanced in place
        step, slot, J = ints[:, STEP], ints[:, SLOT], tok.shape[1]
        j = torch.arange(J, device=self.device)
        keep = j < torch.minimum(count, ints[:, MAX_NEW] - step)[:, None]  # [m, J]
        stop = torch.zeros_like(keep)
        if self.stops.shape[1]:
            stop = (self.stops[lo: lo + tok.shape[0], None, :] == tok[:, :, None]).any(-1) & keep
            keep &= (stop.long().cumsum(-1) - stop.long()) == 0  # nothing after the first stop token
        n = keep.sum(-1)
        r, c = keep.nonzero(as_tuple=True)
        at = (slot[r], step[r] + c)  # (before the steps advance)
        self.tokens[at], self.logps[at], self.iterations[at] = tok[r, c], lp[r, c].to(self.logps.dtype), iteration
        ints[:, STEP] += n
        done = (ints[:, STEP] >= ints[:, MAX_NEW]) | (stop & keep).any(-1)
        last = tok.gather(1, (n - 1).unsqueeze(1)).squeeze(1)
        self.last = torch.cat([self.last[:lo], last]) if lo else last
        return done, n

    def finish(self, rows: list[int], reason: str | None = None) -> list[tuple[Request, Generation]]:
        """Read back the outputs of `rows` (finish reason from their last token unless given)."""
        if not rows:
            return []
        idx = torch.tensor(rows, device=self.device)
        meta = self.ints[idx].tolist()
        slots = idx.new_tensor([m[SLOT] for m in meta])
        toks, lps = self.tokens[slots].tolist(), self.logps[slots].tolist()
        iters = self.iterations[slots].tolist() if self.speculative else None
        out = []
        for i, row in enumerate(rows):
            r, n = self.requests[row], meta[i][STEP]
            t = toks[i][:n]
            why = reason or ("stop" if t and t[-1] in r.params.stop_token_ids else "length")
            versions = self.versions(r.first_iteration, n) if iters is None else self.versions_at(iters[i][:n])
            out.append((r, Generation(token_ids=t, logprobs=lps[i][:n], finish_reason=why, versions=versions)))
            self.free.append(meta[i][SLOT])
        return out

    def keep(self, rows: list[int]) -> None:
        """Keep only `rows` (in this order)."""
        idx = torch.tensor(rows, dtype=torch.long, device=self.device)
        self.floats, self.ints, self.stops, self.last = (self.floats[idx], self.ints[idx], self.stops[idx],
                                                         self.last[idx] if len(self.last) else self.last)
        self.requests = [self.requests[i] for i in rows]
        if not rows:
            self.stops = self.stops[:, :0]
        self._summarise()

    # ----------------------------------------------------------------- versions
    def mark_version(self, iteration: int, version: int) -> None:
        if self.marks[-1][0] == iteration:
            self.marks[-1] = (iteration, version)
        else:
            self.marks.append((iteration, version))

    def versions(self, first: int, n: int) -> list[int]:
        """The weight version of each of n tokens sampled at iterations first, first+1, ..."""
        out, marks = [], self.marks
        k = bisect_right(marks, (first, float("inf"))) - 1
        for it in range(first, first + n):
            while k + 1 < len(marks) and marks[k + 1][0] <= it:
                k += 1
            out.append(marks[k][1])
        return out

    def versions_at(self, iterations: list[int]) -> list[int]:
        """The weight version of tokens sampled at these (ascending) engine iterations."""
        marks = self.marks
        return [marks[bisect_right(marks, (it, float("inf"))) - 1][1] for it in iterations]


def fill_holes(n: int, finished: list[int]) -> list[int]:
    """The surviving rows of a batch of n, ordered so that survivors already in the first
    n - len(finished) places stay where they are and the holes take rows from the tail."""
    gone = set(finished)
    k = n - len(gone)
    order = list(range(k))
    tail = [i for i in range(k, n) if i not in gone]
    for hole, row in zip((i for i in range(k) if i in gone), tail):
        order[hole] = row
    return order


def resolve_requests(done: list[tuple[Request, Generation | BaseException]]) -> None:
    """Complete every request's future with its generation or its error (once)."""
    for req, out in done:
        if req.future.done():
            continue
        if isinstance(out, BaseException):
            req.future.set_exception(out)
        else:
            req.future.set_result(out)
