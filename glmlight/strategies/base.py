"""The RLStrategy protocol: what an RL module (glmlight/algorithms/base.py) reads of its trainer's strategy.

Every strategy glmlight builds for several ranks declares all of it (`RLDDPStrategy`: data parallel with the
module unwrapped, glmlight/strategies/distributed.py; `RLFSDPStrategy`: FSDP2, glmlight/strategies/fsdp.py;
`RLDeepSpeedStrategy`: ZeRO, glmlight/strategies/zero.py; their NPU forms, glmlight/strategies/npu.py).
A strategy that is not an `RLStrategy` (Lightning's one-device strategies) has none of these needs: the
module trains as one process. Callers ask `rl_strategy(trainer)` instead of guessing attribute by attribute.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch


@runtime_checkable
class RLStrategy(Protocol):
    # The module averages gradients over the ranks itself, after all its passes (data parallel, unwrapped),
    # so a rank may run fewer forward / backward passes than the others.
    rl_gradient_sync: bool
    # Every forward and backward of a model is a collective (FSDP2, ZeRO): every rank runs as many passes as
    # the busiest one, and the strategy reduces the gradients.
    rl_sharded: bool
    # The strategy's engine reduces, clips and takes the optimizer step (DeepSpeed).
    rl_engine_steps: bool

    def configure_for(self, module: Any) -> None:
        """Before the models are set up (`RLModule.configure_model`): what the strategy takes from the module."""

    def shard(self, model: torch.nn.Module) -> torch.nn.Module:
        """`model` as this strategy holds it on each rank (called for each of `module.sharded_modules()` when
        `rl_sharded`); the model itself where the strategy shards it elsewhere or not at all."""


def rl_strategy(trainer: Any) -> RLStrategy | None:
    """The trainer's strategy when it is an `RLStrategy` (None without a trainer or for one that is not)."""
    if trainer is None:
        return None
    return trainer.strategy if isinstance(trainer.strategy, RLStrategy) else None
