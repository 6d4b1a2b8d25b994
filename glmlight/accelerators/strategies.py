"""Lightning strategies and precision plugins for Ascend NPUs, and the Trainer kwargs that use them.

Lightning knows nothing of NPUs beyond the accelerator registry, so three of its
defaults are wrong for ``accelerator="npu"``; each has a fix here:

- one device: Lightning picks ``SingleDeviceStrategy("cpu")`` for any custom
  accelerator -> `SingleNPUStrategy` places the model on ``npu:N``;
- several devices: DDP's backend comes from torch's device map (torch_npu maps
  ``npu`` to ``hccl``) -> `NPUDDPStrategy` names ``hccl`` outright and only
  launches workers as fresh processes (``popen`` or ``spawn``), because torch_npu
  cannot be re-initialised in a forked child;
- mixed precision: ``MixedPrecision`` and ``FSDPPrecision`` autocast on ``"cuda"``
  -> `NPUMixedPrecision` / `NPUFSDPPrecision` autocast on ``"npu"``.

`make_npu_trainer_kwargs` assembles these explicitly (what ``build()`` uses);
`install_connector_defaults` makes plain ``Trainer(accelerator="npu")`` choose them
too, by wrapping two methods of Lightning's private ``_AcceleratorConnector``. The
wrappers change nothing unless the accelerator is an `NPUAccelerator`; if a future
Lightning renames those methods they are skipped and `NPUAccelerator.setup_device`
/ `NPUAccelerator.setup` refuse a CPU strategy or a CUDA autocast with one line
instead of training silently on the CPU.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
import warnings
from typing import Any, Literal

import torch
from lightning.fabric.connector import _convert_precision_to_unified_args
from lightning.pytorch.plugins.precision import FSDPPrecision, MixedPrecision
from lightning.pytorch.strategies import (
    DDPStrategy,
    DeepSpeedStrategy,
    FSDPStrategy,
    SingleDeviceStrategy,
    Strategy,
)

import glmlight.accelerators.npu as npu_lib  # device_type() looked up per call: the one device indirection
from glmlight.accelerators.npu import NPU_DEVICE_TYPE, NPUAccelerator
from glmlight.errors import AcceleratorUnavailable, ConfigError

_MIXED = ("16-mixed", "bf16-mixed")
STRATEGY_NAMES = ("auto", "single", "ddp", "deepspeed", "fsdp")


def _autocast_dtype(precision: str) -> torch.dtype:
    return torch.bfloat16 if precision == "bf16-mixed" else torch.float16


class NPUMixedPrecision(MixedPrecision):
    """``bf16-mixed`` / ``16-mixed`` with ``torch.autocast("npu")`` (and an NPU GradScaler for fp16)."""

    def __init__(
        self, precision: Literal["16-mixed", "bf16-mixed"] = "bf16-mixed", scaler: torch.amp.GradScaler | None = None
    ) -> None:
        if scaler is None and precision == "16-mixed":
            scaler = torch.amp.GradScaler(device=npu_lib.device_type())
        super().__init__(precision, device=NPU_DEVICE_TYPE, scaler=scaler)

    def autocast_context_manager(self) -> torch.autocast:
        return torch.autocast(npu_lib.device_type(), dtype=_autocast_dtype(self.precision), cache_enabled=False)


class NPUFSDPPrecision(FSDPPrecision):
    """`FSDPPrecision` whose mixed modes autocast on ``"npu"`` and scale fp16 losses on the NPU."""

    device = NPU_DEVICE_TYPE

    def __init__(self, precision: str = "bf16-mixed") -> None:
        with warnings.catch_warnings():  # the parent builds a CUDA scaler for 16-mixed; replaced below
            warnings.filterwarnings("ignore", message="torch.cuda.amp.GradScaler is enabled")
            super().__init__(precision)  # type: ignore[arg-type]
        if precision == "16-mixed":
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            self.scaler = ShardedGradScaler(device=npu_lib.device_type())

    def forward_context(self) -> Any:
        if "mixed" in self.precision:
            return torch.autocast(npu_lib.device_type(), dtype=_autocast_dtype(self.precision))
        return super().forward_context()


class SingleNPUStrategy(SingleDeviceStrategy):
    """Train on one NPU: the model and batches go to ``npu:<device>``."""

    strategy_name = "single_npu"

    def __init__(
        self,
        device: int | torch.device = 0,
        accelerator: NPUAccelerator | None = None,
        checkpoint_io: Any = None,
        precision_plugin: Any = None,
    ) -> None:
        if isinstance(device, int):
            device = npu_lib.npu_device(device)
        super().__init__(
            device=device, accelerator=accelerator, checkpoint_io=checkpoint_io, precision_plugin=precision_plugin
        )


def _check_start_method(start_method: str) -> None:
    if start_method not in ("popen", "spawn"):
        raise ConfigError(
            f"start_method={start_method!r} forks the trainer process, and torch_npu cannot be re-initialised in "
            "a forked child; use 'popen' (default) or 'spawn'"
        )


class NPUDDPStrategy(DDPStrategy):
    """DDP over HCCL; one process per NPU, launched as fresh processes (never forked).

    ``start_method="popen"`` (default) re-runs the training script once per extra
    local rank, like ``torchrun``; ``"spawn"`` starts fresh interpreters from Python.
    """

    strategy_name = "ddp_npu"

    def __init__(
        self,
        process_group_backend: str = "hccl",
        start_method: Literal["popen", "spawn"] = "popen",
        **kwargs: Any,
    ) -> None:
        _check_start_method(start_method)
        super().__init__(process_group_backend=process_group_backend, start_method=start_method, **kwargs)


def _select_deepspeed_npu_accelerator() -> None:
    """Make DeepSpeed use its NPU accelerator: ``DS_ACCELERATOR=npu`` before deepspeed is imported."""
    chosen = os.environ.get("DS_ACCELERATOR", "")
    if chosen not in ("", "npu"):
        raise ConfigError(f"DS_ACCELERATOR={chosen!r}, but DeepSpeed on Ascend needs DS_ACCELERATOR=npu (or unset)")
    os.environ["DS_ACCELERATOR"] = "npu"
    if "deepspeed" in sys.modules:  # it already picked an accelerator at import time
        from deepspeed.accelerator import get_accelerator

        name = get_accelerator().device_name()
        if not str(name).startswith("npu"):
            raise ConfigError(
                f"deepspeed was imported before DS_ACCELERATOR=npu was set and chose {name!r}; "
                "import glmlight.accelerators (or set DS_ACCELERATOR=npu) before importing deepspeed"
            )


class NPUDeepSpeedStrategy(DeepSpeedStrategy):
    """DeepSpeed ZeRO on NPUs: DeepSpeed's NPU accelerator and the ``hccl`` backend.

    Lightning's DeepSpeed strategy accepts only CUDA; this subclass accepts
    `NPUAccelerator` instead. ``stage`` is the ZeRO stage (0-3).
    """

    strategy_name = "deepspeed_npu"

    def __init__(self, stage: int = 2, process_group_backend: str = "hccl", **kwargs: Any) -> None:
        _select_deepspeed_npu_accelerator()
        if importlib.util.find_spec("deepspeed") is None:
            raise AcceleratorUnavailable("strategy 'deepspeed' needs DeepSpeed: pip install 'glmlight[deepspeed]'")
        super().__init__(stage=stage, process_group_backend=process_group_backend, **kwargs)

    def setup_environment(self) -> None:
        if not isinstance(self.accelerator, NPUAccelerator):
            raise ConfigError(f"NPUDeepSpeedStrategy needs accelerator='npu', got {type(self.accelerator).__name__}")
        DDPStrategy.setup_environment(self)  # skips DeepSpeedStrategy's CUDA-only check


class NPUFSDPStrategy(FSDPStrategy):
    """FSDP on NPUs over ``hccl``; pair it with `NPUFSDPPrecision`.

    FSDP gets ``device_id=<index>``, which torch resolves to the current accelerator
    (the NPU once torch_npu is imported). A ``device_mesh`` tuple is built on ``npu``.
    """

    strategy_name = "fsdp_npu"

    def __init__(self, process_group_backend: str = "hccl", **kwargs: Any) -> None:
        super().__init__(process_group_backend=process_group_backend, **kwargs)

    def setup_environment(self) -> None:
        mesh_shape = self.kwargs.get("device_mesh")
        if isinstance(mesh_shape, tuple):  # Lightning would build it on "cuda"
            del self.kwargs["device_mesh"]
        super().setup_environment()
        if isinstance(mesh_shape, tuple):
            from torch.distributed.device_mesh import init_device_mesh

            self.kwargs["device_mesh"] = init_device_mesh(npu_lib.device_type(), mesh_shape)


def _normalise_precision(precision: Any) -> str:
    unified = _convert_precision_to_unified_args(precision)
    return "32-true" if unified is None else str(unified)


def make_npu_trainer_kwargs(
    strategy: str = "auto",
    devices: int | str | list[int] = "auto",
    precision: Any = "bf16-mixed",
    *,
    zero_stage: int = 2,
    num_nodes: int = 1,
) -> dict[str, Any]:
    """Trainer kwargs for NPU training: ``Trainer(**make_npu_trainer_kwargs(...), max_steps=...)``.

    Args:
        strategy: "auto" (one NPU -> single device, else DDP), "single", "ddp",
            "deepspeed" (ZeRO stage ``zero_stage``) or "fsdp".
        devices: as Lightning's ``devices``; indexes count within ``ASCEND_RT_VISIBLE_DEVICES``.
        precision: any Lightning precision; mixed modes get an NPU autocast plugin.
        zero_stage: DeepSpeed ZeRO stage, 0-3.
        num_nodes: machines taking part; more than one forces a distributed strategy.

    Returns:
        ``accelerator`` (an `NPUAccelerator`), ``devices`` (explicit indexes),
        ``num_nodes``, ``strategy`` (a strategy object) and either ``plugins``
        (``[NPUMixedPrecision]`` or ``[NPUFSDPPrecision]``) or ``precision`` (a string).
    """
    name = strategy.lower()
    if name not in STRATEGY_NAMES:
        raise ConfigError(f"trainer.strategy={strategy!r} on NPU must be one of {', '.join(STRATEGY_NAMES)}")
    if zero_stage not in (0, 1, 2, 3):
        raise ConfigError(f"zero_stage={zero_stage} must be 0, 1, 2 or 3")
    precision = _normalise_precision(precision)
    accelerator = NPUAccelerator()
    indexes = accelerator.parse_devices(devices)
    if not indexes:
        raise ConfigError(f"trainer.devices={devices!r} selects no NPU")
    if name == "auto":
        name = "single" if len(indexes) == 1 and num_nodes == 1 else "ddp"
    if name == "single" and (len(indexes) != 1 or num_nodes != 1):
        raise ConfigError(f"strategy 'single' runs on one NPU, but devices={devices!r} and num_nodes={num_nodes}")

    chosen: Strategy
    if name == "single":
        chosen = SingleNPUStrategy(indexes[0])
    elif name == "ddp":
        chosen = NPUDDPStrategy()
    elif name == "deepspeed":
        chosen = NPUDeepSpeedStrategy(stage=zero_stage)
    else:
        chosen = NPUFSDPStrategy()

    kwargs: dict[str, Any] = {"accelerator": accelerator, "devices": indexes, "num_nodes": num_nodes, "strategy": chosen}
    if name == "fsdp":
        kwargs["plugins"] = [NPUFSDPPrecision(precision)]
    elif name != "deepspeed" and precision in _MIXED:
        kwargs["plugins"] = [NPUMixedPrecision(precision)]  # type: ignore[arg-type]
    else:
        kwargs["precision"] = precision  # true precisions are device-agnostic; DeepSpeed does its own
    return kwargs


def register_strategies(registry: Any) -> None:
    """Add ``ddp_npu``, ``ddp_spawn_npu``, ``deepspeed_npu`` and ``fsdp_npu`` to Lightning's StrategyRegistry.

    Registered by hand rather than through the parents' ``register_strategies``:
    FSDP's would list the name as plain FSDP, which Lightning refuses off CUDA.
    """
    registry.register("ddp_npu", NPUDDPStrategy, description="DDP on Ascend NPUs (hccl, popen)", override=True)
    registry.register(
        "ddp_spawn_npu",
        NPUDDPStrategy,
        description="DDP on Ascend NPUs (hccl, spawn)",
        override=True,
        start_method="spawn",
    )
    registry.register(
        "deepspeed_npu", NPUDeepSpeedStrategy, description="DeepSpeed on Ascend NPUs (hccl)", override=True
    )
    registry.register("fsdp_npu", NPUFSDPStrategy, description="FSDP on Ascend NPUs (hccl)", override=True)


def default_npu_strategy(parallel_devices: list[torch.device], num_nodes: int = 1) -> Strategy:
    """What ``strategy="auto"`` means on NPUs: one device -> `SingleNPUStrategy`, else `NPUDDPStrategy`."""
    if num_nodes == 1 and len(parallel_devices) <= 1:
        return SingleNPUStrategy(parallel_devices[0] if parallel_devices else 0)
    return NPUDDPStrategy()


def _default_npu_precision(connector: Any) -> Any:
    """An NPU autocast plugin for a mixed ``precision=`` flag, or None to keep Lightning's choice."""
    if connector._precision_plugin_flag is not None or connector._precision_flag not in _MIXED:
        return None
    if isinstance(connector.strategy, FSDPStrategy):
        return NPUFSDPPrecision(connector._precision_flag)
    if isinstance(connector.strategy, (SingleDeviceStrategy, DDPStrategy)) and not isinstance(
        connector.strategy, DeepSpeedStrategy
    ):
        return NPUMixedPrecision(connector._precision_flag)
    return None


def install_connector_defaults() -> bool:
    """Make ``Trainer(accelerator="npu")`` pick NPU strategies and autocast; idempotent.

    Returns False (and changes nothing) if Lightning no longer has the wrapped methods.
    """
    from lightning.pytorch.trainer.connectors import accelerator_connector

    connector_cls = accelerator_connector._AcceleratorConnector
    if getattr(connector_cls, "_glmlight_npu_defaults", False):
        return True
    choose_strategy = getattr(connector_cls, "_choose_strategy", None)
    init_precision = getattr(connector_cls, "_check_and_init_precision", None)
    if choose_strategy is None or init_precision is None:
        return False

    @functools.wraps(choose_strategy)
    def _choose_strategy(self: Any) -> Any:
        if isinstance(getattr(self, "accelerator", None), NPUAccelerator):
            return default_npu_strategy(self._parallel_devices, self._num_nodes_flag)
        return choose_strategy(self)

    @functools.wraps(init_precision)
    def _check_and_init_precision(self: Any) -> Any:
        if isinstance(getattr(self, "accelerator", None), NPUAccelerator):
            plugin = _default_npu_precision(self)
            if plugin is not None:
                return plugin
        return init_precision(self)

    connector_cls._choose_strategy = _choose_strategy
    connector_cls._check_and_init_precision = _check_and_init_precision
    connector_cls._glmlight_npu_defaults = True
    return True
