"""Train/inference mismatch corrections as composable callbacks (the probability contract).

Each one reads k = π_old / π_rollout per token in `on_experience` (after the
train-side old log-probs exist, before the loss) and composes with whatever ran
before it: weights multiply, loss masks intersect. What each removed is counted
in the step's metrics under its own name.
"""

from __future__ import annotations

import lightning.pytorch as pl

from glmlight.ops import corrections as ops
from glmlight.sample import Experience


class _Correction(pl.Callback):
    name = "correction"
    # True: rejected tokens leave the loss denominator (loss_mask 0);
    # False: they stay in the denominator with weight 0.
    removes_from_denominator = True

    def compute(self, batch: Experience) -> ops.CorrectionResult:
        raise NotImplementedError

    def on_experience(self, trainer: pl.Trainer, module: pl.LightningModule, batch: Experience) -> None:
        if batch.old_logprobs is None:
            raise RuntimeError(f"{type(self).__name__} needs train-side old log-probs (run inside RLModule)")
        res = self.compute(batch)
        batch.token_weights = batch.token_weights * res.weights
        if self.removes_from_denominator:
            batch.loss_mask = batch.loss_mask * res.keep_mask
        for k, v in res.stats.items():
            batch.stats[f"{self.name}/{k}"] = float(v)


class IcePop(_Correction):
    """IcePop (Ring-1T; GLM-5 Eq. 1): weight k inside [low, high], 0 outside.

    GLM-5 uses [1/β, β] with β = 2 (the default); Ring-1T implementations use [0.5, 5].
    `keep_in_denominator=True` (slime's behaviour) keeps popped tokens in Σ m.
    """

    name = "icepop"

    def __init__(self, low: float = 0.5, high: float = 2.0, keep_in_denominator: bool = True):
        if not 0 <= low < high:
            raise ValueError(f"IcePop needs 0 <= low < high, got [{low}, {high}]")
        self.low, self.high = low, high
        self.removes_from_denominator = not keep_in_denominator

    def compute(self, batch: Experience) -> ops.CorrectionResult:
        return ops.icepop(batch.old_logprobs, batch.rollout_logprobs, batch.loss_mask, self.low, self.high)


class TruncatedIS(_Correction):
    """Truncated importance sampling (Yao et al.; slime --use-tis): weight clamp(k, clip_low, clip_high)."""

    name = "tis"
    removes_from_denominator = False

    def __init__(self, clip_low: float = 0.0, clip_high: float = 2.0):
        self.clip_low, self.clip_high = clip_low, clip_high

    def compute(self, batch: Experience) -> ops.CorrectionResult:
        return ops.truncated_is(batch.old_logprobs, batch.rollout_logprobs, batch.loss_mask,
                                self.clip_low, self.clip_high)


class MaskedIS(_Correction):
    """Masked importance sampling: weight k inside [low, high]; tokens outside leave the loss."""

    name = "mis"

    def __init__(self, low: float = 0.5, high: float = 2.0):
        self.low, self.high = low, high

    def compute(self, batch: Experience) -> ops.CorrectionResult:
        return ops.masked_is(batch.old_logprobs, batch.rollout_logprobs, batch.loss_mask, self.low, self.high)


class RejectionSampling(_Correction):
    """Token / sequence / geometric-level IS with truncate, clip or mask (rejection) modes,
    a veto threshold and optional batch normalisation.

    Porting settings: verl `rollout_is_level` / `rollout_rs` → `level`, `rollout_is_threshold`
    (upper) / `..._lower` → `high` / `low`, `rollout_token_veto_threshold` → `veto_threshold`,
    `rollout_is_batch_normalize` → `batch_normalize`; slime `tis_mode`, `tis_level`,
    `tis_lower_bound` / `tis_upper_bound`, `tis_veto_threshold` likewise.
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

    def compute(self, batch: Experience) -> ops.CorrectionResult:
        return ops.rejection_sampling(batch.old_logprobs, batch.rollout_logprobs, batch.loss_mask, self.level,
                                      self.low, self.high, self.mode, self.veto_threshold, self.batch_normalize)

