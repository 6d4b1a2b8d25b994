"""What the embedded engine's fast runners (GLM-5 `glm_runner`, dense-attention `dense_runner`) share: a
running batch of rows, each with its own cached length, kept in preallocated per-layer caches that grow
by doubling; rows are admitted at the end and compacted in place as others finish, their replay records
(`records.Capture`) beside them. Also the weights both read at the ends of the model (`head_weights`) and
their compiled decode step (`compile_decode`)."""

from __future__ import annotations

from functools import partial
from typing import Any, Callable

import torch

from glmlight.engines.local.records import Capture

DECODE_WINDOW = 64  # compiled decode steps attend over cache positions [0, T), T a multiple of this


def _dynamic(t: torch.Tensor, *dims: int) -> torch.Tensor:
    """Marks dims of t as varying, so that a compiled decode step is traced for any size of them
    (sizes 0 and 1 still get graphs of their own)."""
    for d in dims:
        torch._dynamo.maybe_mark_dynamic(t, d)
    return t


def _map_tensors(fn: partial, f: Callable[[torch.Tensor], torch.Tensor]) -> partial:
    """`fn` with f applied to its tensor keyword arguments."""
    return partial(fn.func, *fn.args, **{k: f(v) if isinstance(v, torch.Tensor) else v for k, v in fn.keywords.items()})


def head_weights(model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor, float, torch.Tensor]:
    """The model's token embedding, final norm (weight, epsilon) and lm_head weight."""
    m = model.model
    return m.embed_tokens.weight, m.norm.weight, m.norm.variance_epsilon, model.lm_head.weight


def compile_decode(step: Callable[..., Any], device: torch.device, compile: bool) -> Callable[..., Any] | None:
    """`step` as one `torch.compile`d graph (None without `compile`). On CPU the step's host code is
    generated as C++ too (`cpp_wrapper`): about a tenth of a decode step at small batches went to the
    Python wrapper calling the kernels."""
    options = {"cpp_wrapper": True} if device.type == "cpu" else None
    return torch.compile(step, options=options) if compile else None


class RowCache:
    """Row bookkeeping of a runner: `n` running rows, their cached lengths `lens` and the longest
    `_max_len`, in caches of `rows_cap` rows x `capacity` positions. A runner defines `_alloc(rows,
    capacity)` (new caches holding the running rows, calling `_alloc_capture`) and `_move_rows(dst, src, T)`
    (copy cache rows, and the records' rows); `capture` holds the replay records its `set_capture` asked for."""

    device: torch.device
    n: int
    lens: torch.Tensor
    _max_len: int
    rows_cap: int
    capacity: int
    capture: Capture | None
    admit: Callable[[list[list[int]]], torch.Tensor]  # the runner's prefill of new rows: their last logits

    def _alloc(self, rows: int, capacity: int) -> None:
        raise NotImplementedError

    def _move_rows(self, dst: torch.Tensor, src: torch.Tensor, T: int) -> None:
        raise NotImplementedError

    def _ensure(self, rows: int, length: int) -> None:
        if rows > self.rows_cap or length > self.capacity:  # grow what is short (at least 2x), keep the rest
            self._alloc(self.rows_cap if rows <= self.rows_cap else max(rows, 2 * self.rows_cap),
                        self.capacity if length <= self.capacity else max(length, 2 * self.capacity))

    def records(self, row: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The replay records of `row`, for the positions it ran (`Capture.read`)."""
        return (None, None) if self.capture is None else self.capture.read(row, int(self.lens[row]))

    def _alloc_capture(self, rows: int, capacity: int, n: int, T: int) -> None:
        """The records' buffers for caches of rows x capacity, keeping rows [:n] positions [:T]."""
        if self.capture is not None:
            self.capture.alloc(rows, capacity, n, T)
            for r in self.capture.parts:
                for t in r.buf:
                    _dynamic(t, 0)

    def reset(self) -> None:
        self.n, self._max_len = 0, 0
        self.lens = self.lens[:0]

    @torch.inference_mode()
    def keep(self, rows: list[int]) -> None:
        """Keep only `rows` (indices into the running batch, in this order). Only rows that
        change place are copied, so the engine fills holes with rows from the tail."""
        if not rows:
            self.reset()
            return
        moved = [(dst, src) for dst, src in enumerate(rows) if dst != src]
        if moved:
            dst = torch.tensor([d for d, _ in moved], device=self.device)
            src = torch.tensor([s for _, s in moved], device=self.device)
            self._move_rows(dst, src, self._max_len)
        self.lens = self.lens[torch.tensor(rows, device=self.device)]
        self.n = len(rows)
        self._max_len = int(self.lens.max())

    @torch.inference_mode()
    def admit_shared(self, prompts: list[list[int]]) -> torch.Tensor:
        """`admit(prompts)` with each distinct prompt prefilled once: the copies of a prompt (a GRPO group's
        samples, an evaluation's k answers) get the cache rows of its first prefill, copied, and its logits
        (and its replay records). A row's cache holds its own tokens only, but its numbers are those of a row
        alone only up to float32 rounding: a batched matmul may round a row differently with the number and
        lengths of the rows computed beside it (see `glm_runner`'s module docstring). So the copies hold
        what their own prefills would have held to that rounding, not necessarily bit for bit; where the
        rounding decides a near-tied top-k choice (an expert, a DSA key) all copies take the first prefill's,
        and their replay records say so: records are what the engine chose, which the trainer replays."""
        first: dict[tuple[int, ...], int] = {}
        index = [first.setdefault(tuple(p), len(first)) for p in prompts]
        if len(first) == len(prompts):
            return self.admit(prompts)
        n0 = self.n
        logits = self.admit([list(p) for p in first])
        self._ensure(n0 + len(prompts), self._max_len + 1)
        self.keep(list(range(n0)) + [n0 + j for j in index])  # (keep gathers its sources before it writes)
        return logits[torch.tensor(index, device=logits.device)]

    def _pad_prompts(self, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Room for `prompts` as new rows; their ids right-padded with 0 [m, S] and lengths [m]."""
        m, S = len(prompts), max(len(p) for p in prompts)
        self._ensure(self.n + m, max(S, self._max_len) + 1)
        ids = torch.zeros(m, S, dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, : len(p)] = torch.tensor(p, dtype=torch.long)
        return ids.to(self.device), torch.tensor([len(p) for p in prompts], device=self.device)

    def _admitted(self, lens: torch.Tensor) -> None:
        """The rows of `lens` were prefilled at the end of the batch."""
        self.lens = torch.cat([self.lens, lens])
        self.n += len(lens)
        self._max_len = max(self._max_len, int(lens.max()))
