"""Stand-in for ``torch_npu.npu.utils``: selecting the current NPU (on CPU, recorded).

The device state the other modules share lives here, in private names, as torch_npu keeps its
device-index function (``_get_device_index``) in this module.
"""

from __future__ import annotations

import torch

import torch_npu
from torch_npu._record import record as _record

__all__ = ["current_device", "set_device", "synchronize"]

_state = {"current": 0, "initialized": False}


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


def _reset(current: int | None = 0) -> None:
    _state["current"] = current or 0
    _state["initialized"] = False


def synchronize(device=None):
    _record("synchronize", _index(device))


def set_device(device):
    """Select the current NPU; like torch_npu, an index past device_count() is an error."""
    index = _index(device)
    _record("set_device", str(device), index)
    count = torch_npu.npu.device_count()
    if not 0 <= index < count:
        raise RuntimeError(f"Invalid device ID {index}: only {count} NPU(s) visible")
    _state["current"] = index
    _state["initialized"] = True


def current_device():
    _record("current_device", _state["current"])
    return int(_state["current"])
