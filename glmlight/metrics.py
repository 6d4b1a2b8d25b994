"""The one route of glmlight's metrics: the algorithm's per-step metrics and every callback's
(weight sync, evaluation) go through `log_metrics`, so all of them land on the same x-axis (RL
steps) in every logger, and the progress bar shows the latest values.

Every call is also appended, as one JSON object with its `rl_step`, to
`<trainer.default_root_dir>/metrics.jsonl` (rank zero), whatever the logger: the run report
(`glmlight.run.report`) and `scripts/report.py` read that file. A resumed run appends to it; a later
line for the same RL step and key replaces an earlier one.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import lightning.pytorch as pl

METRICS_FILE = "metrics.jsonl"


def log_metrics(trainer: pl.Trainer, metrics: dict[str, float]) -> None:
    """Send `metrics` to every logger at the current RL step (the number of RL steps completed
    before the one in progress, Lightning's step for a batch's training metrics), flush them, keep
    them as the latest values (`latest_metrics(trainer)`) and append them to metrics.jsonl."""
    step = trainer.fit_loop.epoch_loop._batches_that_stepped
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=step)
        logger.save()
    latest_metrics(trainer).update(metrics)
    if trainer.is_global_zero:
        _append_jsonl(trainer, step, metrics)


def latest_metrics(trainer: pl.Trainer) -> dict[str, Any]:
    """The newest value of every metric logged through `log_metrics` in this fit."""
    return trainer.__dict__.setdefault("_glmlight_latest_metrics", {})


def _append_jsonl(trainer: pl.Trainer, step: int, metrics: dict[str, float]) -> None:
    root = trainer.default_root_dir
    rl_step = metrics.get("rl_step", getattr(trainer.lightning_module, "rl_step", step))
    row: dict[str, Any] = {"step": int(step), "rl_step": int(rl_step)}
    for k, v in metrics.items():
        if k != "rl_step":
            v = float(v)
            row[k] = v if math.isfinite(v) else None
    os.makedirs(root, exist_ok=True)
    with open(os.path.join(root, METRICS_FILE), "a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")
