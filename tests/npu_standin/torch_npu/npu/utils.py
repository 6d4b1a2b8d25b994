"""Stand-in for ``torch_npu.npu.utils``: the device functions of ``torch.npu``, on CPU, recorded.

Device count: ``NPU_STANDIN_DEVICES`` (default 2) is the number of "physical"
NPUs; ``ASCEND_RT_VISIBLE_DEVICES``, when set, keeps only the listed ones that
exist, as the CANN runtime does, and indexes count within that list.
``NPU_STANDIN_DEVICES=0`` plays a machine where torch_npu imports but finds no
device (no driver, or every device hidden).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from typing import Any

import torch

from torch_npu._record import record

_state = {"current": 0, "initialized": False}


def _physical_count() -> int:
    return int(os.environ.get("NPU_STANDIN_DEVICES", "2"))


def device_count() -> int:
    """Visible NPUs: the physical ones filtered by ASCEND_RT_VISIBLE_DEVICES."""
    physical = _physical_count()
    visible = os.environ.get("ASCEND_RT_VISIBLE_DEVICES")
    count = physical
    if visible is not None:
        ids = [int(part) for part in visible.split(",") if part.strip()]
        count = len([i for i in ids if 0 <= i < physical])
    record("device_count", count)
    return count


def is_available() -> bool:
    available = device_count() > 0
    record("is_available", available)
    return available


def is_initialized() -> bool:
    return bool(_state["initialized"])


def _index(device: int | str | torch.device | None) -> int:
    """The index a torch_npu call would use for ``device`` (None or no index = current)."""
    if isinstance(device, int):
        return device
    index: int | None = None
    if isinstance(device, torch.device):
        index = device.index
    elif isinstance(device, str) and ":" in device:
        index = int(device.rsplit(":", 1)[1])
    return int(_state["current"]) if index is None else index


def set_device(device: int | str | torch.device) -> None:
    """Select the current NPU; like torch_npu, an index past device_count() is an error."""
    index = _index(device)
    record("set_device", str(device), index)
    if not 0 <= index < device_count():
        raise RuntimeError(f"Invalid device ID {index}: only {device_count()} NPU(s) visible")
    _state["current"] = index
    _state["initialized"] = True


def current_device() -> int:
    record("current_device", _state["current"])
    return int(_state["current"])


def get_device_name(device: int | str | torch.device | None = None) -> str:
    record("get_device_name", _index(device))
    return "Ascend stand-in (CPU)"


def synchronize(device: int | str | torch.device | None = None) -> None:
    record("synchronize", _index(device))


def empty_cache() -> None:
    record("empty_cache")


def memory_stats(device: int | str | torch.device | None = None) -> OrderedDict[str, Any]:
    """The keys torch.npu.memory_stats shares with torch.cuda.memory_stats; the stand-in owns no
    NPU memory, so every counter is 0."""
    record("memory_stats", _index(device))
    stats: OrderedDict[str, Any] = OrderedDict()
    for metric in ("allocated_bytes", "reserved_bytes", "active_bytes", "inactive_split_bytes"):
        for pool in ("all", "large_pool", "small_pool"):
            for kind in ("current", "peak", "allocated", "freed"):
                stats[f"{metric}.{pool}.{kind}"] = 0
    stats["num_alloc_retries"] = 0
    stats["num_ooms"] = 0
    return stats


def memory_allocated(device: int | str | torch.device | None = None) -> int:
    return int(memory_stats(device)["allocated_bytes.all.current"])


def max_memory_allocated(device: int | str | torch.device | None = None) -> int:
    return int(memory_stats(device)["allocated_bytes.all.peak"])


def reset_peak_memory_stats(device: int | str | torch.device | None = None) -> None:
    record("reset_peak_memory_stats", _index(device))


def manual_seed(seed: int) -> None:
    record("manual_seed", int(seed))


def manual_seed_all(seed: int) -> None:
    record("manual_seed_all", int(seed))


def get_amp_supported_dtype() -> list[torch.dtype]:
    return [torch.float16, torch.bfloat16]


def _reset(current: int | None = 0) -> None:
    _state["current"] = current or 0
    _state["initialized"] = False


# Stream and event types, for libraries (DeepSpeed) that look them up at import time.
Stream = torch.Stream
Event = torch.Event
