"""SampleTable: every N RL steps, a table of prompts, completions and rewards
(a W&B table when logging to W&B, else appended to samples.jsonl in the run directory)."""

from __future__ import annotations

import json
import os
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.loggers import WandbLogger
from typing_extensions import override


class SampleTable(pl.Callback):
    """Every `every_n_steps` RL steps, `num_samples` of the step's samples as a table.

    Args:
        every_n_steps: the period in RL steps (0: off).
        num_samples: rows per table.
    """

    columns = ["rl_step", "prompt", "completion", "reward", "status"]

    def __init__(self, every_n_steps: int = 10, num_samples: int = 8):
        self.every_n_steps = every_n_steps
        self.num_samples = num_samples

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        # Steps 1, 1 + N, 1 + 2N, ... (the first table shows the policy before much training).
        if self.every_n_steps <= 0 or (module.rl_step - 1) % self.every_n_steps or not hasattr(batch, "samples"):
            return
        tok = trainer.datamodule.tokenizer
        rows = [[module.rl_step, tok.decode(s.prompt_ids), tok.decode(s.response_ids), s.reward, s.status.value]
                for s in batch.samples[: self.num_samples]]
        wandb_loggers = [lg for lg in trainer.loggers if isinstance(lg, WandbLogger)]
        for lg in wandb_loggers:
            lg.log_table(key="samples", columns=self.columns, data=rows,
                         step=trainer.fit_loop.epoch_loop._batches_that_stepped)
        if not wandb_loggers and trainer.is_global_zero:
            path = os.path.join(trainer.default_root_dir, "samples.jsonl")
            os.makedirs(trainer.default_root_dir, exist_ok=True)
            with open(path, "a", encoding="utf-8") as f:
                for r in rows:
                    f.write(json.dumps(dict(zip(self.columns, r))) + "\n")
