"""Logging from callbacks on the same x-axis as the module's own metrics (RL steps)."""

from __future__ import annotations

import lightning.pytorch as pl


def log_metrics(trainer: pl.Trainer, metrics: dict[str, float]) -> None:
    """Send `metrics` to every logger at the step Lightning uses for this batch's training metrics
    (the number of completed batches, i.e. RL steps, before this one)."""
    step = trainer.fit_loop.epoch_loop._batches_that_stepped
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=step)
