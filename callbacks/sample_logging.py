"""SampleTable: every N RL steps, the step's samples as a table: the prompt and its question (the last
user message), the completion, the label the reward compared it with, the reward and the reward's info (verifier outcome, judge score, code test results), status, the policy versions that
produced the tokens, the tokens corrections masked or zero-weighted, and the dropped samples with
their drop reason.

Rows are appended to `<run dir>/samples.jsonl` (read by `scripts/samples.py runs/<name> --worst 10`)
and, when logging to W&B, also logged as the W&B table `samples`.
"""

from __future__ import annotations

import json
import os
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.loggers import WandbLogger
from typing_extensions import override

from glmlight.hooks import RLCallback
from glmlight.prompt import last_user_message
from glmlight.sample import Experience, Sample

SAMPLES_FILE = "samples.jsonl"


class SampleTable(RLCallback):
    """Every `every_n_steps` RL steps (steps 1, 1 + N, ...), `num_samples` trained samples and up to
    `num_dropped` dropped ones as table rows.

    Args:
        every_n_steps: the period in RL steps (0: off).
        num_samples: trained samples per table.
        num_dropped: dropped samples per table (with their drop reason).
    """

    columns = ["rl_step", "policy_version", "group_id", "rollout_id", "question", "prompt", "completion", "label",
               "reward", "reward_info", "status", "versions", "action_tokens", "masked_tokens", "zero_weight_tokens",
               "drop_reason"]

    def __init__(self, every_n_steps: int = 10, num_samples: int = 8, num_dropped: int = 8):
        self.every_n_steps = every_n_steps
        self.num_samples = num_samples
        self.num_dropped = num_dropped

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        # Steps 1, 1 + N, 1 + 2N, ... (the first table shows the policy before much training).
        if self.every_n_steps <= 0 or (module.rl_step - 1) % self.every_n_steps or not hasattr(batch, "samples"):
            return
        dm = trainer.datamodule
        source = getattr(dm, "source", None)
        rows = [self.row(dm.tokenizer, module, s, batch, i, source=source)
                for i, s in enumerate(batch.samples[: self.num_samples])]
        dropped = getattr(dm, "last_dropped", [])[: self.num_dropped]
        rows += [self.row(dm.tokenizer, module, s, source=source) for s in dropped]
        for lg in trainer.loggers:
            if isinstance(lg, WandbLogger):
                data = [[r[c] if not isinstance(r[c], (dict, list)) else json.dumps(r[c], default=str)
                         for c in self.columns] for r in rows]
                lg.log_table(key="samples", columns=self.columns, data=data,
                             step=trainer.fit_loop.epoch_loop._batches_that_stepped)
        if trainer.is_global_zero:
            os.makedirs(trainer.default_root_dir, exist_ok=True)
            with open(os.path.join(trainer.default_root_dir, SAMPLES_FILE), "a", encoding="utf-8") as f:
                for r in rows:
                    f.write(json.dumps(r, default=str) + "\n")

    def row(self, tok: Any, module: pl.LightningModule, s: Sample, batch: Experience | None = None,
            index: int | None = None, source: Any = None) -> dict[str, Any]:
        """One table row; `batch`/`index` (a trained sample's row) give the corrections' token counts, `source`
        (the prompt source the sample's `prompt_index` points into) its question."""
        acted = [v for v, m in zip(s.versions, s.loss_mask) if m]
        # the reward's info, or an agent episode's environment outcome (env/* keys, env_error)
        info = s.metadata.get("reward_info") or {k: v for k, v in s.metadata.items() if k.startswith("env")}
        masked = zero_weight = None
        if batch is not None and index is not None:
            action = batch.action_mask[index] > 0
            loss = batch.loss_mask[index] > 0
            masked = int((action & ~loss).sum())  # removed from the loss (and its denominator)
            if batch.token_weights is not None:
                zero_weight = int((loss & (batch.token_weights[index] == 0)).sum())  # kept in the denominator, weight 0
        return {
            "rl_step": module.rl_step, "policy_version": int(getattr(module, "policy_version", 0)),
            "group_id": s.group_id, "rollout_id": s.rollout_id,
            "question": _question(s, source), "prompt": tok.decode(s.prompt_ids),
            "completion": tok.decode(s.response_ids), "label": _jsonable(s.metadata.get("label")), "reward": s.reward, "reward_info": _jsonable(info),
            "status": s.status.value, "versions": sorted(set(acted)), "action_tokens": len(acted),
            "masked_tokens": masked, "zero_weight_tokens": zero_weight,
            "drop_reason": s.metadata.get("drop_reason") if batch is None else None,
        }


def _question(s: Sample, source: Any) -> str | None:
    """What the prompt asks: its `question` (synthetic tasks), else the last user message of the prompt the
    sample came from; None when neither is known (a chat template's rendering stays in `prompt`)."""
    if s.metadata.get("question") is not None:
        return str(s.metadata["question"])
    index = s.metadata.get("prompt_index")
    if source is None or index is None:
        return None
    try:
        return last_user_message(source[index].messages)
    except (IndexError, KeyError, AttributeError, TypeError):
        return None


def _jsonable(x: Any) -> Any:
    try:
        json.dumps(x)
        return x
    except (TypeError, ValueError):
        return json.loads(json.dumps(x, default=str))
