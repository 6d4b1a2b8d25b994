"""HeldOutEval: greedy answers on the task's fixed held-out prompts, at the start
of training and every N RL steps (after the weight sync, so the engine serves the
newest policy)."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from typing_extensions import override

from glmlight.metrics import log_metrics
from lightning.pytorch.utilities import rank_zero_info


class HeldOutEval(pl.Callback):
    """Evaluates the policy on the task's held-out prompts at the start and every `every_n_steps`
    RL steps, through the engine (after the weight sync), and logs `eval/*`.

    Args:
        every_n_steps: the period in RL steps (0: off).
    """

    def __init__(self, every_n_steps: int = 10):
        self.every_n_steps = every_n_steps
        self.history: list[tuple[int, dict[str, float]]] = []

    def _run(self, trainer: pl.Trainer, module: pl.LightningModule, rl_step: int) -> None:
        dm = trainer.datamodule
        if dm is None or not hasattr(dm, "evaluate"):
            return
        metrics = dm.evaluate()
        if not metrics:
            return
        self.history.append((rl_step, metrics))
        log_metrics(trainer, {**metrics, "rl_step": float(rl_step)})
        rank_zero_info(f"[eval] rl_step {rl_step}: " + "  ".join(f"{k}={v:.3f}" for k, v in metrics.items()))

    @override
    def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        if self.every_n_steps > 0:
            self._run(trainer, module, module.rl_step)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step = module.rl_step
        if self.every_n_steps > 0 and step % self.every_n_steps == 0:
            self._run(trainer, module, step)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"history": self.history}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.history = [tuple(h) for h in state_dict.get("history", [])]
