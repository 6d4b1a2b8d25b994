"""Ascend NPU support for Lightning: ``Trainer(accelerator="npu")``.

Importing this package registers the ``"npu"`` accelerator and the ``ddp_npu``,
``ddp_spawn_npu``, ``deepspeed_npu`` and ``fsdp_npu`` strategy names with Lightning,
and teaches Lightning's ``strategy="auto"`` / mixed ``precision=`` to pick NPU
variants when the accelerator is ``"npu"``. It does not import torch_npu: that
happens when an NPU is first needed, so this import is safe on any machine.
Importing it again, or calling `register` again, changes nothing.

    import glmlight.accelerators
    trainer = lightning.Trainer(accelerator="npu", devices=8, precision="bf16-mixed")

or, with every choice explicit (what the Hydra entry point does):

    trainer = lightning.Trainer(**make_npu_trainer_kwargs("deepspeed", devices=8, zero_stage=3), max_steps=100)
"""

from lightning.pytorch.accelerators import AcceleratorRegistry
from lightning.pytorch.strategies import StrategyRegistry

from glmlight.accelerators.npu import (
    NPUAccelerator,
    device_type,
    npu_device,
    require_npu,
)
from glmlight.accelerators.strategies import (
    NPUDDPStrategy,
    NPUDeepSpeedStrategy,
    NPUFSDPPrecision,
    NPUFSDPStrategy,
    NPUMixedPrecision,
    SingleNPUStrategy,
    install_connector_defaults,
    make_npu_trainer_kwargs,
    register_strategies,
)

__all__ = [
    "NPUAccelerator",
    "NPUDDPStrategy",
    "NPUDeepSpeedStrategy",
    "NPUFSDPPrecision",
    "NPUFSDPStrategy",
    "NPUMixedPrecision",
    "SingleNPUStrategy",
    "device_type",
    "make_npu_trainer_kwargs",
    "npu_device",
    "register",
    "require_npu",
]


def register() -> None:
    """Register the NPU accelerator, strategies and connector defaults with Lightning (idempotent)."""
    NPUAccelerator.register_accelerators(AcceleratorRegistry)
    register_strategies(StrategyRegistry)
    install_connector_defaults()


register()
