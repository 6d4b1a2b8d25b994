"""Stand-in for ``torch_npu.npu.autocast_utils``."""

from __future__ import annotations

import torch

__all__ = ["get_amp_supported_dtype"]


def get_amp_supported_dtype():
    return [torch.float16, torch.bfloat16]
