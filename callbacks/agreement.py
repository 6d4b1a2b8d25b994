"""The base of RoutingAgreement and IndexAgreement (model and sparse contracts): do the trainer's
forward passes make the discrete choices the engine made for the same tokens?

Every `every_n_steps` RL steps, on the first `num_sequences` sequences of the step:

- the engine's choices are its replay records (`Sample.routed_experts` / `.indexer_topk`: what ran
  while it generated; at fit start the monitor asks the engine to record them). An engine that
  cannot record but exposes its model in this process (`engine.model`) is measured on a prefill
  of that model instead; otherwise the check is skipped, saying so once;
- the trainer's choices are those its own forward uses (`PolicyScoring.forward_logits`: glmlight's
  GLM-5 forward or the model's, with `algo.replay` applied), captured during a no-grad forward.

With `algo.replay` on, the trainer uses the engine's choices, so the agreement is 1 by construction;
with it off, it measures how often near-ties fall the other way.
"""

from __future__ import annotations

import logging

import lightning.pytorch as pl
import torch

from glmlight.hooks import RLCallback
from glmlight.models.glm5.replay import Replay, indexer_layers, moe_layers, transformers_replay
from glmlight.engines.base import CapturesReplay, HoldsModel
from glmlight.sample import Experience

log = logging.getLogger(__name__)


class ChoiceAgreement(RLCallback):
    """Logs `<name>/layer_<i>` and `<name>/mean` (see the module docstring). Subclasses set `name`,
    `kind` ("experts" | "index"), `record` (the Experience field) and `score`.

    Args:
        every_n_steps: the period in RL steps (0: off).
        num_sequences: how many of the step's sequences are compared.
    """

    name = "agreement"
    kind = "experts"
    record = "routed_experts"
    reads_old_logprobs = False  # runs its own forwards

    def __init__(self, every_n_steps: int = 10, num_sequences: int = 4):
        self.every_n_steps, self.num_sequences = every_n_steps, num_sequences
        self._warned = False

    def on_fit_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        if self.every_n_steps <= 0:
            return
        dm = getattr(trainer, "datamodule", None)
        if dm is None:
            return
        with dm.engine_aside() as engine:
            if not isinstance(engine, CapturesReplay):
                return
            try:
                engine.capture_replay(**{"routing" if self.kind == "experts" else "index": True})
            except Exception as e:  # noqa: BLE001 - then the engine's model is measured by a prefill
                log.info("%s: the engine does not record its choices (%s); measuring a prefill", type(self).__name__, e)

    def score(self, engine: torch.Tensor, trainer: torch.Tensor) -> float:
        """Agreement of two [N, k] choices (rows both sides have)."""
        raise NotImplementedError

    def on_experience(self, trainer: pl.Trainer, module: pl.LightningModule, batch: Experience) -> None:
        if self.every_n_steps <= 0 or module.rl_step % self.every_n_steps:
            return
        sub = batch.select(list(range(min(self.num_sequences, batch.batch_size))))
        was_training = module.policy.training
        module.policy.eval()
        try:
            with torch.no_grad():
                engine = self._engine_choices(trainer, sub)
                if engine is None:
                    return
                used: dict = {}
                module.scoring.forward_logits(module.policy, sub, capture=used)
        finally:
            module.policy.train(was_training)
        per_layer = {}
        for layer, e in engine.items():
            t = used.get(self.kind, {}).get(layer)
            if t is None:
                continue
            e, t = e.to(t.device), t.reshape(*e.shape[:2], -1)
            rows = (e[..., 0] >= 0) & (t[..., 0] >= 0)
            if t.shape[-1] == e.shape[-1] and bool(rows.any()):
                per_layer[layer] = self.score(e[rows], t[rows])
        for layer, v in per_layer.items():
            batch.stats[f"{self.name}/layer_{layer}"] = v
        if per_layer:
            batch.stats[f"{self.name}/mean"] = sum(per_layer.values()) / len(per_layer)

    def _engine_choices(self, trainer: pl.Trainer, sub: Experience) -> dict[int, torch.Tensor] | None:
        """The engine's choices per decoder layer, [B, S, k] in the batch layout (-1: none)."""
        rec = getattr(sub, self.record)
        engine = getattr(getattr(trainer, "datamodule", None), "engine", None)
        model = engine.model if isinstance(engine, HoldsModel) else None
        if rec is not None:
            layers = (moe_layers if self.kind == "experts" else indexer_layers)(trainer.lightning_module.policy)
            if len(layers) == rec.shape[2]:
                return {layer: rec[:, :, j].long() for j, layer in enumerate(layers)}
        if not isinstance(model, torch.nn.Module):
            if not self._warned:
                log.warning("%s: no replay records and the engine's model is not in this process; check skipped",
                            type(self).__name__)
                self._warned = True
            return None
        cap: dict = {}
        dev = next(model.parameters()).device
        # the engine's model outside the rollout: under the generation lock, as every such use
        with trainer.datamodule.engine_aside(), transformers_replay(model, Replay(capture=cap, shape=tuple(sub.input_ids.shape))):
            model(input_ids=sub.input_ids.to(dev), attention_mask=sub.attention_mask.to(dev),
                  position_ids=sub.position_ids.to(dev), use_cache=False)
        out = cap.get(self.kind, {})
        if self.kind == "index":  # a prefill's rows for queries with at most k keys are not selections
            for layer, cols in out.items():
                pos = sub.position_ids.to(cols.device)[..., None]
                keep = (pos >= cols.shape[-1]) & sub.attention_mask.bool().to(cols.device)[..., None]
                out[layer] = torch.where(keep, cols, torch.full_like(cols, -1))
        return out
