"""Stand-in for ``torch_npu.npu.memory``: the caching allocator's statistics (the stand-in owns no NPU
memory, so every counter is 0; calls recorded)."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from torch_npu._record import record as _record
from torch_npu.npu.utils import _index

__all__ = ["empty_cache", "max_memory_allocated", "memory_allocated", "memory_stats", "reset_peak_memory_stats"]


def empty_cache():
    _record("empty_cache")


def memory_stats(device=None):
    """The keys torch.npu.memory_stats shares with torch.cuda.memory_stats."""
    _record("memory_stats", _index(device))
    stats: OrderedDict[str, Any] = OrderedDict()
    for metric in ("allocated_bytes", "reserved_bytes", "active_bytes", "inactive_split_bytes"):
        for pool in ("all", "large_pool", "small_pool"):
            for kind in ("current", "peak", "allocated", "freed"):
                stats[f"{metric}.{pool}.{kind}"] = 0
    stats["num_alloc_retries"] = 0
    stats["num_ooms"] = 0
    return stats


def memory_allocated(device=None):
    return int(memory_stats(device)["allocated_bytes.all.current"])


def max_memory_allocated(device=None):
    return int(memory_stats(device)["allocated_bytes.all.peak"])


def reset_peak_memory_stats(device=None):
    _record("reset_peak_memory_stats", _index(device))
