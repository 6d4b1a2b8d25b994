"""The extension points of glmlight's callbacks.

`RLCallback` (glmlight.hooks): the base of every glmlight callback. It declares the hooks the RL step
calls beyond Lightning's own, in the order they fire: `on_rollout_samples(trainer, module, samples,
counts, policy_version)` on each rollout round's samples before they are accepted, and
`on_experience(trainer, module, batch)` after the train-side old log-probs (`batch.old_logprobs`)
and the reference log-probs exist, before the advantages and the loss. An `on_experience` hook may
read the batch, log into `batch.stats`, or change `batch.token_weights` (multiply) and
`batch.loss_mask` (intersect); one that does not read the old log-probs sets
`reads_old_logprobs = False`, so the module may skip computing them.

`Correction`: the base of the train/inference mismatch corrections (IcePop, TIS, MIS,
rejection sampling). A subclass implements `compute(batch) -> CorrectionResult` from
`glmlight.ops.corrections`; the base composes it with what ran before.
"""

from __future__ import annotations

import lightning.pytorch as pl
from typing_extensions import override

from glmlight.hooks import RLCallback
from glmlight.ops.corrections import CorrectionResult
from glmlight.sample import Experience


class Correction(RLCallback):
    """Base of the per-token corrections: weights multiply into `batch.token_weights`; removed tokens
    leave the loss mask (and so the loss denominator) when `removes_from_denominator`, else they stay
    in the denominator with weight 0. Statistics are logged as `<name>/<stat>`.

    Subclasses set `name` and implement `compute`.
    """

    name = "correction"
    reads_old_logprobs = True
    removes_from_denominator = True

    def compute(self, batch: Experience) -> CorrectionResult:
        """Weights, keep mask and statistics for this batch (shapes [B, T])."""
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

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(name=self.name)
