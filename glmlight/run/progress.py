"""The progress bar of an RL run: `RL step 12/50` with the reward, the held-out pass@1 and the
throughput, read from the metrics route (`glmlight.metrics.latest_metrics`)."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import TQDMProgressBar
from typing_extensions import override

from glmlight.metrics import latest_metrics

# what the bar shows: metric -> short name
SHOWN = {"rollout/reward_mean": "reward", "eval/heldout/pass@1": "eval_pass@1", "rollout/tokens_per_s": "gen_tok/s",
         "train/tokens_per_s": "train_tok/s"}


class RLProgressBar(TQDMProgressBar):
    """Counts RL steps (rollout batches), not optimizer steps or epochs.

    Args:
        refresh_rate: redraw every this many RL steps.
    """

    def __init__(self, refresh_rate: int = 1):
        super().__init__(refresh_rate=refresh_rate)

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, *_: Any) -> None:
        super().on_train_epoch_start(trainer)
        module = trainer.lightning_module
        self.train_progress_bar.total = max(trainer.max_steps // module.optimizer_steps_per_rl_step, 0) or None
        self.train_progress_bar.initial = module.rl_step
        self.train_progress_bar.n = module.rl_step
        self.train_progress_bar.set_description("RL step")

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        bar = self.train_progress_bar
        if bar is None or bar.disable:
            return
        bar.n = pl_module.rl_step
        if pl_module.rl_step % self.refresh_rate == 0 or pl_module.rl_step == bar.total:
            bar.set_postfix(self.get_metrics(trainer, pl_module))
            bar.refresh()

    @override
    def get_metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        latest = latest_metrics(trainer)
        return {short: f"{latest[key]:.3g}" for key, short in SHOWN.items() if key in latest}
