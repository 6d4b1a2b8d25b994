"""Stand-in for ``torch_npu.npu.random``: seeding (recorded)."""

from __future__ import annotations

from torch_npu._record import record as _record

__all__ = ["manual_seed", "manual_seed_all"]


def manual_seed(seed):
    _record("manual_seed", int(seed))


def manual_seed_all(seed):
    _record("manual_seed_all", int(seed))
