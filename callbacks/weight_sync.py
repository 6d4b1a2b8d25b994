"""WeightSync: push the trainer's weights into the rollout engine (the sync contract).

gather (state_dict of the policy; a LoRA policy's merged weights; under FSDP2 whole tensors gathered
from the shards bucket by bucket as the engine takes them, `glmlight.strategies.fsdp.full_weights`) → send
(engine.update_weights, which casts to the engine's dtype) → acknowledge: the policy
version advances only when the engine acknowledges the new version. Every data-parallel
rank pushes to its own engine; ranks that share one fleet of servers (glmlight/engines/base.py
SharedFleet) push once, from the rank that owns it, and the others adopt the version. Pushes the current weights once at the start of fit,
so a resumed run's engine serves the restored weights.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import lightning.pytorch as pl
from typing_extensions import override

from glmlight.engines.base import SharedFleet
from glmlight.hooks import RLCallback
from glmlight.metrics import log_metrics
from glmlight.models.lora import is_lora, merged_named_tensors
from glmlight.strategies.fsdp import full_weights


class WeightSync(RLCallback):
    """Pushes the policy's weights into the rollout engine and advances the policy version once the
    engine acknowledges them (the sync contract).

    Args:
        every_n_steps: push after every this many RL steps (1: on-policy).
        reset_optimizer: forget the Adam moments after each push (GLM-5 agentic RL).

    Raises:
        ValueError: if every_n_steps < 1.
        RuntimeError: when the engine acknowledges another version than the one pushed.
    """

    syncs_weights = True  # build() checks that some callback keeps the engine up to date (glmlight.hooks.SyncsWeights)

    def __init__(self, every_n_steps: int = 1, reset_optimizer: bool = False):
        if every_n_steps < 1:
            raise ValueError("WeightSync.every_n_steps must be >= 1")
        self.every_n_steps = every_n_steps
        self.reset_optimizer = reset_optimizer
        self.num_syncs = 0

    @staticmethod
    def _engine(trainer: pl.Trainer):
        dm = trainer.datamodule
        if dm is None or not hasattr(dm, "engine"):
            raise RuntimeError("WeightSync needs a RolloutDataModule (trainer.datamodule.engine)")
        return dm.engine

    def push(self, trainer: pl.Trainer, module: pl.LightningModule, version: int) -> dict[str, float]:
        engine = self._engine(trainer)
        t0 = time.perf_counter()
        # whole tensors, also from FSDP2 shards (a collective then); a LoRA policy: base names, adapters merged
        if is_lora(module.policy):
            named: Any = merged_named_tensors(module.policy)
            nbytes, gather_seconds = sum(t.numel() * t.element_size() for _, t in named), 0.0
        else:
            named = full_weights(module.policy)
        # trainer.deterministic=true with an async producer: the push lands between two of its batches, at a
        # point the step count fixes (RolloutDataModule.weight_update_point); otherwise at once
        point = getattr(trainer.datamodule, "weight_update_point", contextlib.nullcontext)
        with point():
            if isinstance(engine, SharedFleet) and trainer.world_size > 1:
                self._push_shared(trainer, engine, named, version)
            else:
                engine.update_weights(named, version=version)
        if engine.version != version:
            raise RuntimeError(f"engine acknowledged version {engine.version}, expected {version}")
        if not is_lora(module.policy):
            nbytes, gather_seconds = named.nbytes, named.gather_seconds  # counted as the engine took them
        module.policy_version = version
        self.num_syncs += 1
        return {"sync/seconds": time.perf_counter() - t0, "sync/bytes": float(nbytes),
                "sync/gather_seconds": gather_seconds, "sync/version": float(version)}

    @staticmethod
    def _push_shared(trainer: pl.Trainer, engine: SharedFleet, named: Any, version: int) -> None:
        """Data-parallel ranks that share one fleet of servers: once every rank's rollout is done, the owning rank
        pushes, the others take part in the gather (under FSDP2 a collective) and then adopt the version."""
        trainer.strategy.barrier("glmlight-fleet-before-push")
        if engine.owns_fleet:
            engine.update_weights(named, version=version)
        else:
            for _ in named:
                pass
        trainer.strategy.barrier("glmlight-fleet-after-push")
        if not engine.owns_fleet:
            engine.adopt_version(version)

    @override
    def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self.push(trainer, module, module.policy_version)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if module.rl_step % self.every_n_steps:
            return
        metrics = self.push(trainer, module, module.policy_version + 1)
        if self.reset_optimizer:
            module.reset_optimizer_state()
        log_metrics(trainer, metrics)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"num_syncs": self.num_syncs}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.num_syncs = state_dict.get("num_syncs", 0)


