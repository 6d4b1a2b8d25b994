"""Stand-in for ``torch_npu.npu``, installed as ``torch.npu`` (as torch_npu does).

Each function is defined in the module torch_npu defines it in, with torch_npu's parameters
(tests/unit/accelerators/test_npu_wheels.py compares them with the released wheel): the device count and availability
here, device selection in `utils`, allocator statistics in `memory`, seeding in `random`, autocast
dtypes in `autocast_utils`, stream and event types in `streams`. Everything runs on CPU and is
recorded in ``torch_npu.calls``.

Device count: ``NPU_STANDIN_DEVICES`` (default 2) is the number of "physical" NPUs;
``ASCEND_RT_VISIBLE_DEVICES``, when set, keeps only the listed ones that exist, as the CANN runtime
does, and indexes count within that list. ``NPU_STANDIN_DEVICES=0`` plays a machine where torch_npu
imports but finds no device (no driver, or every device hidden).
"""

from __future__ import annotations

import os

from torch_npu._record import record as _record

__all__ = [
    "Event",
    "Stream",
    "current_device",
    "device_count",
    "empty_cache",
    "get_amp_supported_dtype",
    "get_device_name",
    "is_available",
    "is_initialized",
    "manual_seed",
    "manual_seed_all",
    "max_memory_allocated",
    "memory_allocated",
    "memory_stats",
    "reset_peak_memory_stats",
    "set_device",
    "synchronize",
]


def device_count() -> int:
    """Visible NPUs: the physical ones filtered by ASCEND_RT_VISIBLE_DEVICES."""
    physical = int(os.environ.get("NPU_STANDIN_DEVICES", "2"))
    visible = os.environ.get("ASCEND_RT_VISIBLE_DEVICES")
    count = physical
    if visible is not None:
        ids = [int(part) for part in visible.split(",") if part.strip()]
        count = len([i for i in ids if 0 <= i < physical])
    _record("device_count", count)
    return count


def is_available():
    available = device_count() > 0
    _record("is_available", available)
    return available


def is_initialized():
    return bool(_state["initialized"])


def get_device_name(device_name=None):
    _record("get_device_name", _index(device_name))
    return "Ascend stand-in (CPU)"


# after the functions above, which utils.set_device calls back into (as torch_npu's modules do)
from .utils import _index, _state, current_device, set_device, synchronize  # noqa: E402
from .streams import Event, Stream  # noqa: E402
from .autocast_utils import get_amp_supported_dtype  # noqa: E402
from .random import manual_seed, manual_seed_all  # noqa: E402
from .memory import (  # noqa: E402
    empty_cache, max_memory_allocated, memory_allocated, memory_stats, reset_peak_memory_stats)
