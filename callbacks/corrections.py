"""Train/inference mismatch corrections as composable callbacks (the probability contract).

Each one reads k = π_old / π_rollout per token in `on_experience` (after the
train-side old log-probs exist, before the loss) and composes with whatever ran
before it: weights multiply, loss masks intersect. What each removed is counted
in the step's metrics under its own name.
"""

from __future__ import annotations

from typing_extensions import override

from .base import Correction
from glmlight.ops import corrections as ops
from glmlight.sample import Experience


class IcePop(Correction):
    """IcePop (Ring-1T, arXiv 2510.18855; GLM-5 Eq. 1): weight k inside [low, high], 0 outside.

    Args:
        low, high: the band on k = π_old / π_rollout. GLM-5 uses [1/β, β] with β = 2 (the default);
            Ring-1T implementations use [0.5, 5].
        keep_in_denominator: True (slime's behaviour) keeps popped tokens in the loss
            denominator Σ m with weight 0; False removes them from it.

    Raises:
        ValueError: unless 0 <= low < high.

    Example::

        callbacks: {icepop: {_target_: glmlight.callbacks.IcePop, low: 0.5, high: 2.0}}
    """

    name = "icepop"

    def __init__(self, low: float = 0.5, high: float = 2.0, keep_in_denominator: bool = True):
        if not 0 <= low < high:
            raise ValueError(f"IcePop needs 0 <= low < high, got [{low}, {high}]")
        self.low, self.high = low, high
        self.removes_from_denominator = not keep_in_denominator

    @override
    def compute(self, batch: Experience) -> ops.CorrectionResult:
        return ops.icepop(batch.old_logprobs, batch.rollout_logprobs, batch.loss_mask, self.low, self.high)


class TruncatedIS(Correction):
    """Truncated importance sampling (Yao et al. 2025; slime --use-tis): weight clamp(k, low, high).

    Args:
        low, high: the clamp; no token is removed.
    """

    name = "tis"
    removes_from_denominator = False

    def __init__(self, low: float = 0.0, high: float = 2.0):
        self.low, self.high = low, high

    @override
    def compute(self, batch: Experience) -> ops.CorrectionResult:
        return ops.truncated_is(batch.old_logprobs, batch.rollout_logprobs, batch.loss_mask,
                                self.low, self.high)


class MaskedIS(Correction):
    """Masked importance sampling: weight k inside [low, high]; tokens outside leave the loss
    (and its denominator).

    Args:
        low, high: the band on k.
    """

    name = "mis"

    def __init__(self, low: float = 0.5, high: float = 2.0):
        self.low, self.high = low, high

    @override
    def compute(self, batch: Experience) -> ops.CorrectionResult:
        return ops.masked_is(batch.old_logprobs, batch.rollout_logprobs, batch.loss_mask, self.low, self.high)


class RejectionSampling(Correction):
    """Token / sequence / geometric-level IS with truncate, clip or mask (rejection) modes,
    a veto threshold and optional batch normalisation.

    Porting settings: verl `rollout_is_level` / `rollout_rs` → `level`, `rollout_is_threshold`
    (upper) / `..._lower` → `high` / `low`, `rollout_token_veto_threshold` → `veto_threshold`,
    `rollout_is_batch_normalize` → `batch_normalize`; slime `tis_mode`, `tis_level`,
    `tis_lower_bound` / `tis_upper_bound`, `tis_veto_threshold` likewise.

    Args:
        level: "token", "sequence" or "geometric" ratio.
        mode: "truncate" (min(ratio, high)), "clip" (clamp to [low, high]) or "mask" (reject outside).
        low, high: the bounds.
        veto_threshold: reject a whole sequence with any token whose k is below it (None: off).
        batch_normalize: rescale kept weights to mean 1.

    Raises:
        ValueError: for an unknown level or mode.
    """

    name = "rs"

    def __init__(self, level: str = "token", mode: str = "mask", low: float = 0.5, high: float = 2.0,
                 veto_threshold: float | None = 1e-4, batch_normalize: bool = False):
        if level not in ("token", "sequence", "geometric"):
            raise ValueError(f"RejectionSampling.level must be token, sequence or geometric, got {level!r}")
        if mode not in ("truncate", "clip", "mask"):
            raise ValueError(f"RejectionSampling.mode must be truncate, clip or mask, got {mode!r}")
        self.level, self.mode, self.low, self.high = level, mode, low, high
        self.veto_threshold, self.batch_normalize = veto_threshold, batch_normalize
        self.name = f"rs_{level}"

    @override
    def compute(self, batch: Experience) -> ops.CorrectionResult:
        return ops.rejection_sampling(batch.old_logprobs, batch.rollout_logprobs, batch.loss_mask, self.level,
                                      self.low, self.high, self.mode, self.veto_threshold, self.batch_normalize)

