"""DeepSpeed ZeRO for RL modules: `trainer.strategy=deepspeed trainer.zero_stage=2|3`.

`RLDeepSpeedStrategy` is Lightning's `DeepSpeedStrategy` with what an RL step needs:

- CPUs too: DeepSpeed's CPU accelerator over gloo (``DS_ACCELERATOR=cpu``, set before deepspeed is
  imported); Lightning's own strategy accepts only CUDA devices;
- no batch-size probe of the dataloader (an RL step's batch is generated, not loaded);
- the module's gradient clipping as DeepSpeed's (`configure_for`), which clips its partitioned
  gradients itself;
- an `RLStrategy` (glmlight/strategies/base.py): its flags are declared on the class (`ZeroForRL`, which
  the NPU plugin's form shares: glmlight/strategies/npu.py), never set on a live strategy;
- `RLModule` runs the same number of backward passes on every rank (each one reduces gradient
  buckets collectively), marks the last one of an optimizer step as the gradient-accumulation
  boundary, and lets DeepSpeed's engine take the step (`rl_engine_steps`).

One optimizer only (DeepSpeed's limit): GRPO and OPD, not SAO / CompactionRL (policy and critic).
glmlight's GLM-5 forward is not used (it reads parameters that ZeRO-3 keeps partitioned outside
the modules' own forward). Weight sync gathers ZeRO-3 parameters bucket by bucket
(`glmlight.strategies.fsdp.full_weights`).
"""

from __future__ import annotations

import os
from typing import Any

from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy
from torch.nn import Module

from glmlight.errors import ConfigError


def select_cpu_accelerator() -> None:
    """DeepSpeed picks its accelerator when first imported: make it the CPU one (or say why not)."""
    import sys

    chosen = os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if chosen != "cpu":
        raise ConfigError(f"config error: trainer.accelerator=cpu with trainer.strategy=deepspeed needs "
                          f"DS_ACCELERATOR=cpu (or unset), got {chosen!r}")
    if "deepspeed" in sys.modules:
        from deepspeed.accelerator import get_accelerator

        if get_accelerator().device_name() != "cpu":
            raise ConfigError("config error: deepspeed was imported before DS_ACCELERATOR=cpu was set; "
                              "set DS_ACCELERATOR=cpu before starting")


class ZeroForRL(DeepSpeedStrategy):
    """Lightning's DeepSpeed strategy with what an RL step needs, on the devices Lightning's runs on (an
    `RLStrategy`, glmlight/strategies/base.py): equal backward passes on every rank, DeepSpeed's engine
    steps, no batch-size probe of the dataloader, the module's gradient clipping (`configure_for`).
    `RLDeepSpeedStrategy` adds CPUs; glmlight/strategies/npu.py's `RLNPUDeepSpeedStrategy` is this over
    the NPU plugin's strategy."""

    rl_sharded = True  # every rank runs the same backward passes
    rl_engine_steps = True  # DeepSpeed's engine reduces, clips and steps
    rl_gradient_sync = False

    def __init__(self, stage: int = 2, **kwargs: Any) -> None:
        # train_micro_batch_size_per_gpu in DeepSpeed's config (only its throughput logging reads it): an RL
        # step's batch is generated, so Lightning must not probe the dataloader for it
        kwargs.setdefault("logging_batch_size_per_gpu", 1)
        super().__init__(stage=stage, **kwargs)

    def configure_for(self, module: Any) -> None:
        """Before DeepSpeed is initialised: the module's gradient clipping (0: none) as DeepSpeed's."""
        if isinstance(getattr(module, "critic", None), Module):
            raise ConfigError(f"config error: trainer.strategy=deepspeed takes one optimizer (DeepSpeed's limit), but "
                              f"{type(module).__name__} trains a policy and a critic; use trainer.strategy=fsdp")
        self._init_config_if_needed()
        self.config["gradient_clipping"] = float(module.cfg.grad_clip or 0.0)

    def shard(self, model: Module) -> Module:
        return model  # DeepSpeed partitions the model it initialises (deepspeed.initialize), not here


class RLDeepSpeedStrategy(ZeroForRL):
    """DeepSpeed ZeRO (stage 0-3) for RL modules on CPUs (gloo) or GPUs (nccl); see the module docstring."""

    strategy_name = "rl_deepspeed"

    def setup_environment(self) -> None:
        if self.root_device.type == "cpu":
            DDPStrategy.setup_environment(self)  # DeepSpeedStrategy's refuses anything but CUDA
        else:
            super().setup_environment()

    def setup_distributed(self) -> None:
        if self.root_device.type != "cpu":
            return super().setup_distributed()
        from lightning.fabric.utilities.seed import reset_seed

        reset_seed()  # (the device-index check does not apply to CPU processes)
        self.set_world_ranks()
        self._init_deepspeed_distributed()

    def _setup_model_and_optimizer(self, model: Any, optimizer: Any, lr_scheduler: Any = None) -> tuple[Any, Any]:
        import deepspeed

        # args=None: DeepSpeed takes the device from LOCAL_RANK (Lightning passes the device index,
        # which a CPU device does not have)
        engine, opt, _, _ = deepspeed.initialize(
            args=None, config=self.config, model=model, optimizer=optimizer, lr_scheduler=lr_scheduler,
            model_parameters=[p for p in model.parameters() if p.requires_grad], dist_init_required=False)
        return engine, opt
