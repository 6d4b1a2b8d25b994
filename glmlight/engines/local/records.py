"""Replay capture in the embedded engine: per-row, per-position records of a runner's discrete choices.

A runner that captures keeps, beside its cache, one buffer per layer [rows * capacity, width]
(row r, position p at r * capacity + p): the expert ids each MoE layer chose, or the key positions
each DSA layer selected. Rows move, grow and are read back with the cache rows, so what a finished
request reads is exactly what ran for it, prompt and response (`Sample.routed_experts`,
`Sample.indexer_topk`).
"""

from __future__ import annotations

import torch

from glmlight.sample import expert_dtype, position_dtype


class RowRecords:
    """`layers` buffers [rows * capacity, width] of `dtype` (see the module docstring)."""

    def __init__(self, layers: int, width: int, dtype: torch.dtype, device: torch.device):
        self.layers, self.width, self.dtype, self.device = layers, width, dtype, device
        self.rows = self.capacity = 0
        self.buf: list[torch.Tensor] = []

    def alloc(self, rows: int, capacity: int, keep_rows: int = 0, keep_len: int = 0) -> None:
        """New buffers of rows x capacity, keeping rows [:keep_rows] positions [:keep_len] of the old."""
        new = [torch.zeros(rows * capacity, self.width, dtype=self.dtype, device=self.device)
               for _ in range(self.layers)]
        n, T = min(keep_rows, self.rows), min(keep_len, self.capacity)
        if n and T:
            for old, b in zip(self.buf, new):
                b.view(rows, capacity, -1)[:n, :T] = old.view(self.rows, self.capacity, -1)[:n, :T]
        self.buf, self.rows, self.capacity = new, rows, capacity

    def write(self, layer: int, flat: torch.Tensor, values: torch.Tensor) -> None:
        """values [N, width] at flat indices [N] (row * capacity + position)."""
        self.buf[layer].index_copy_(0, flat, values.reshape(-1, self.width).to(self.dtype))

    def write_at(self, layer: int, rows: torch.Tensor, positions: torch.Tensor, values: torch.Tensor) -> None:
        """values [N, width] for (rows [N], positions [N])."""
        self.write(layer, rows * self.capacity + positions, values)

    def move(self, dst: torch.Tensor, src: torch.Tensor, length: int) -> None:
        """Rows src -> dst (positions [:length])."""
        for b in self.buf:
            v = b.view(self.rows, self.capacity, -1)
            v[dst, :length] = v[src, :length]

    def read(self, row: int, start: int, end: int) -> torch.Tensor:
        """Positions [start, end) of `row`: [end - start, layers, width] (a copy, on the CPU)."""
        if end <= start:
            return torch.zeros(0, self.layers, self.width, dtype=self.dtype)
        return torch.stack([b.view(self.rows, self.capacity, -1)[row, start:end] for b in self.buf], 1).cpu()


class Capture:
    """What a runner records: routed experts (`experts`, per MoE layer) and/or the DSA selection
    (`index`, per layer with its own indexer), as `RowRecords` shaped like the runner's cache."""

    def __init__(self, device: torch.device, *, moe_layers: int, experts_per_tok: int, num_experts: int,
                 indexer_layers: int, index_topk: int, routing: bool, index: bool):
        self.index_topk = index_topk
        self.experts = RowRecords(moe_layers, experts_per_tok, expert_dtype(num_experts), device) \
            if routing and moe_layers else None
        self.index = RowRecords(indexer_layers, index_topk, torch.int32, device) \
            if index and indexer_layers else None

    @property
    def parts(self) -> list[RowRecords]:
        return [r for r in (self.experts, self.index) if r is not None]

    def alloc(self, rows: int, capacity: int, keep_rows: int = 0, keep_len: int = 0) -> None:
        for r in self.parts:
            r.alloc(rows, capacity, keep_rows, keep_len)

    def move(self, dst: torch.Tensor, src: torch.Tensor, length: int) -> None:
        for r in self.parts:
            r.move(dst, src, length)

    def read(self, row: int, ran: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The records of a row that ran positions [0, ran): (experts [ran, L, k], index [ran - k, L, k]
        for the queries at positions k..), each row ascending, in the compact dtypes of `Sample`."""
        experts = None if self.experts is None else self.experts.read(row, 0, ran).sort(dim=-1).values
        index = None
        if self.index is not None:
            k = self.index_topk
            index = self.index.read(row, k, ran) if ran > k else torch.zeros(0, self.index.layers, k,
                                                                            dtype=torch.int32)
            index = index.sort(dim=-1).values.to(position_dtype(max(ran, 1)))
        return experts, index
