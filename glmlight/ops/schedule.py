"""The learning-rate schedule: a multiplier of the base rate per optimizer step."""

from __future__ import annotations

import math
from typing import Callable


def lr_lambda(schedule: str, warmup: int, total: int, min_ratio: float) -> Callable[[int], float]:
    """step -> multiplier: linear warm-up over `warmup` steps ((step + 1) / warmup), then constant (1),
    cosine (min_ratio + (1 − min_ratio)·½(1 + cos(π·p))) or linear (min_ratio + (1 − min_ratio)(1 − p))
    decay, p = (step − warmup) / (total − warmup) clamped to [0, 1] (SGDR, Loshchilov & Hutter 2017,
    arXiv 1608.03983, Eq. 5, without restarts)."""

    def f(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        if schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(total - warmup, 1))
        if schedule == "cosine":
            return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
        return min_ratio + (1 - min_ratio) * (1 - progress)

    return f
