"""Stand-in for ``torch_npu.npu.streams``: stream and event types, for libraries (DeepSpeed) that look
them up at import time; torch's device-generic ones."""

from __future__ import annotations

import torch

__all__ = ["Event", "Stream"]

Stream = torch.Stream
Event = torch.Event
