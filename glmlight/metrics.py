"""The one route of glmlight's metrics: the algorithm's per-step metrics and every callback's
(weight sync, evaluation) go through `log_metrics`, so all of them land on the same x-axis (RL
steps) in every logger, and the progress bar shows the latest values."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl


def log_metrics(trainer: pl.Trainer, metrics: dict[str, float]) -> None:
    """Send `metrics` to every logger at the current RL step (the number of RL steps completed
    before the one in progress, Lightning's step for a batch's training metrics), flush them, and
    keep them as the latest values (`latest_metrics(trainer)`)."""
    step = trainer.fit_loop.epoch_loop._batches_that_stepped
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=step)
        logger.save()
    latest_metrics(trainer).update(metrics)


def latest_metrics(trainer: pl.Trainer) -> dict[str, Any]:
    """The newest value of every metric logged through `log_metrics` in this fit."""
    return trainer.__dict__.setdefault("_glmlight_latest_metrics", {})
