"""The NPU plugin's DDP and DeepSpeed strategies (glmlight/accelerators/strategies.py) as RL strategies:
`trainer.accelerator=npu` with `trainer.strategy=ddp|auto` (several NPUs) or `deepspeed`.

Each is the plugin's class with the RL parts of its CPU / GPU form (`RLDDPStrategy`:
glmlight/strategies/distributed.py; `ZeroForRL`: glmlight/strategies/zero.py), so the flags of
`RLStrategy` (glmlight/strategies/base.py) are declared by a class, never set on a live strategy.
Importing this module imports glmlight.accelerators (which registers the NPU plugin with Lightning): only
the NPU path of glmlight/strategies/trainer_setup.py does.
"""

from __future__ import annotations

from lightning.pytorch.strategies import Strategy

from glmlight.accelerators.strategies import NPUDDPStrategy, NPUDeepSpeedStrategy
from glmlight.strategies.distributed import RLDDPStrategy
from glmlight.strategies.zero import ZeroForRL


class RLNPUDDPStrategy(RLDDPStrategy, NPUDDPStrategy):
    """DDP over HCCL (the plugin's `NPUDDPStrategy`) with the module unwrapped (`RLDDPStrategy`)."""


class RLNPUDeepSpeedStrategy(ZeroForRL, NPUDeepSpeedStrategy):
    """DeepSpeed ZeRO on NPUs (the plugin's `NPUDeepSpeedStrategy`) with the RL parts of `ZeroForRL`."""


def for_rl(strategy: Strategy, *, zero_stage: int) -> Strategy:
    """The RL form of a strategy `make_npu_trainer_kwargs` chose, built as it builds the plugin's (its
    DDP with its defaults, its DeepSpeed at `zero_stage`); any other (one NPU, FSDP) as it is."""
    if isinstance(strategy, NPUDeepSpeedStrategy):
        return RLNPUDeepSpeedStrategy(stage=zero_stage)
    if isinstance(strategy, NPUDDPStrategy):
        return RLNPUDDPStrategy()
    return strategy
