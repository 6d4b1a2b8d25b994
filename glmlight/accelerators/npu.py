"""Ascend NPU accelerator for Lightning.

`NPUAccelerator` is Lightning's `Accelerator` for the device type ``"npu"`` that
`torch_npu` (Huawei's PyTorch adapter for Ascend) registers. torch_npu is never
imported when this module is imported: it is imported the first time an NPU is
actually needed (`require_npu`), so ``import glmlight.accelerators`` stays safe on
machines without it.

Device visibility. ``ASCEND_RT_VISIBLE_DEVICES`` (e.g. ``"4,5,6,7"``) is applied by
the CANN runtime, not by this plugin: ``torch.npu.device_count()`` counts only the
visible devices and every index here (``devices=[0, 1]``, ``npu:0``) is relative
to that list, exactly as CUDA indexes are relative to ``CUDA_VISIBLE_DEVICES``.
Set it before the process starts; changing it after torch_npu has initialised has
no effect.

The device type is spelled in exactly one place, `device_type()`. Every device and
autocast region this plugin builds goes through it, which is also the single spot
a CPU stand-in for torch_npu redirects in the tests.
"""

from __future__ import annotations

import gc
import os
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import torch
from lightning.fabric.accelerators.registry import _AcceleratorRegistry
from lightning.fabric.utilities.types import _DEVICE
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import FSDPPrecision, MixedPrecision

from glmlight.errors import AcceleratorUnavailable, ConfigError

NPU_DEVICE_TYPE = "npu"
"""The torch device type that torch_npu registers (PyTorch's PrivateUse1 backend renamed)."""

VISIBLE_DEVICES_ENV = "ASCEND_RT_VISIBLE_DEVICES"

_INSTALL_HINT = "pip install 'glmlight[npu]' and install the CANN toolkit matching your torch_npu version"


def device_type() -> str:
    """The torch device type NPU tensors live on: ``"npu"``."""
    return NPU_DEVICE_TYPE


def npu_device(index: int) -> torch.device:
    """``torch.device("npu", index)``; ``index`` counts within ``ASCEND_RT_VISIBLE_DEVICES``."""
    return torch.device(device_type(), index)


def _import_torch_npu() -> ModuleType:
    """Import torch_npu (which adds ``torch.npu``) or raise one line saying what is missing."""
    try:
        import torch_npu  # noqa: F401  (the import registers the "npu" device and torch.npu)
    except ModuleNotFoundError as err:
        if err.name != "torch_npu":
            raise AcceleratorUnavailable(
                f"torch_npu is installed but cannot import its dependency {err.name!r}: {_INSTALL_HINT}"
            ) from err
        raise AcceleratorUnavailable(f"torch_npu is not importable: {_INSTALL_HINT}") from err
    except (ImportError, OSError) as err:
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise AcceleratorUnavailable(
            f"torch_npu is installed but failed to import ({first_line}): install the CANN toolkit matching "
            "your torch_npu version and source its set_env.sh (e.g. /usr/local/Ascend/ascend-toolkit/set_env.sh)"
        ) from err
    return torch.npu  # type: ignore[attr-defined]


def _visible_devices_text() -> str:
    visible = os.environ.get(VISIBLE_DEVICES_ENV)
    return f"{VISIBLE_DEVICES_ENV}={visible!r}" if visible is not None else f"{VISIBLE_DEVICES_ENV} unset"


def require_npu() -> ModuleType:
    """Return ``torch.npu`` once torch_npu imports and sees at least one device.

    Raises:
        AcceleratorUnavailable: with one line naming what is missing: torch_npu itself,
            the CANN libraries it loads, or a visible device.
    """
    npu = _import_torch_npu()
    count = npu.device_count() if npu.is_available() else 0
    if count < 1:
        raise AcceleratorUnavailable(
            "torch_npu imports but sees no NPU device: the CANN runtime or driver finds none "
            f"(check `npu-smi info`) or {VISIBLE_DEVICES_ENV} hides them all ({_visible_devices_text()})"
        )
    return npu


def _npu_if_loaded() -> ModuleType | None:
    """``torch.npu`` if torch_npu was already imported, else None (never imports it)."""
    if "torch_npu" not in sys.modules:
        return None
    return getattr(torch, "npu", None)


def _parse_indexes(devices: int | str | Sequence[int]) -> list[int] | None:
    """Turn Lightning's ``devices`` flag into explicit indexes, without range checks.

    ``-1``/``"-1"``/``"auto"`` means all visible devices, ``n``/``"n"`` the first ``n``, ``"0,2"``
    or ``[0, 2]`` those indexes; ``0``/``"0"``/``[]`` means no NPU (None).
    """
    if isinstance(devices, str):
        text = devices.strip().lower()
        if text in ("-1", "auto"):
            return _parse_indexes(-1)
        if "," in text:
            try:
                return [int(part) for part in text.split(",") if part.strip()]
            except ValueError:
                raise ConfigError(f"trainer.devices={devices!r} is not an int, '-1' or a list like '0,1'") from None
        if text.isdigit():
            return _parse_indexes(int(text))
        raise ConfigError(f"trainer.devices={devices!r} is not an int, '-1' or a list like '0,1'")
    if isinstance(devices, bool):
        raise ConfigError(f"trainer.devices={devices!r} must be an int, a string or a list of ints")
    if isinstance(devices, int):
        if devices == -1:
            return list(range(require_npu().device_count()))
        if devices < -1:
            raise ConfigError(f"trainer.devices={devices} is negative; use -1 for all visible NPUs")
        return list(range(devices)) or None
    if isinstance(devices, Sequence):  # list, tuple, or an OmegaConf ListConfig from Hydra
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in devices):
            raise ConfigError(f"trainer.devices={devices!r} must list integer NPU indexes")
        return list(devices) or None
    raise ConfigError(f"trainer.devices={devices!r} must be an int, a string or a list of ints")


class NPUAccelerator(Accelerator):
    """Lightning accelerator for Ascend NPUs (``Trainer(accelerator="npu")``).

    Constructing it checks that torch_npu imports and sees a device, so a missing
    runtime is reported as one `AcceleratorUnavailable` line when the Trainer is built.
    """

    def __init__(self) -> None:
        super().__init__()
        require_npu()

    def setup_device(self, device: torch.device) -> None:
        """Make ``device`` the current NPU of this process (``torch.npu.set_device``)."""
        if device.type != device_type():
            raise ConfigError(
                f"NPUAccelerator was handed device {device}: the strategy is not an NPU strategy; pass "
                "strategy=SingleNPUStrategy(...) or build the Trainer from make_npu_trainer_kwargs()"
            )
        require_npu().set_device(device)

    def setup(self, trainer: Any) -> None:
        """Refuse a mixed-precision plugin that would autocast on another device type (e.g. "cuda")."""
        plugin = trainer.strategy.precision_plugin
        autocast_device = getattr(plugin, "device", "cuda")
        mixed = "mixed" in str(getattr(plugin, "precision", ""))
        if mixed and isinstance(plugin, (MixedPrecision, FSDPPrecision)) and autocast_device != NPU_DEVICE_TYPE:
            raise ConfigError(
                f"precision plugin {type(plugin).__name__} autocasts on {autocast_device!r}, not 'npu'; "
                "use glmlight.accelerators.NPUMixedPrecision or make_npu_trainer_kwargs()"
            )

    def teardown(self) -> None:
        """Free cached NPU memory (like CUDAAccelerator); a no-op if torch_npu was never loaded."""
        gc.collect()
        npu = _npu_if_loaded()
        if npu is not None and npu.is_available():
            npu.empty_cache()

    def get_device_stats(self, device: _DEVICE) -> dict[str, Any]:
        """``torch.npu.memory_stats(device)``: the same flat keys as ``torch.cuda.memory_stats``
        (``"allocated_bytes.all.current"``, ``"num_ooms"``, ...), as CUDAAccelerator returns them."""
        return dict(require_npu().memory_stats(device))

    @staticmethod
    def parse_devices(devices: int | str | list[int]) -> list[int] | None:
        """Indexes (relative to ``ASCEND_RT_VISIBLE_DEVICES``) for the ``devices`` flag, checked
        against ``torch.npu.device_count()``."""
        indexes = _parse_indexes(devices)
        if indexes is None:
            return None
        if len(set(indexes)) != len(indexes):
            raise ConfigError(f"trainer.devices={devices!r} lists an NPU twice")
        count = require_npu().device_count()
        missing = [i for i in indexes if not 0 <= i < count]
        if missing or len(indexes) > count:
            raise AcceleratorUnavailable(
                f"trainer.devices={devices!r} asks for NPU(s) {missing or indexes} but only {count} are visible "
                f"(indexes count within the visible list; {_visible_devices_text()})"
            )
        return indexes

    @staticmethod
    def get_parallel_devices(devices: list[int]) -> list[torch.device]:
        """One ``torch.device("npu", i)`` per index."""
        return [npu_device(i) for i in devices]

    @staticmethod
    def auto_device_count() -> int:
        """All visible NPUs: ``torch.npu.device_count()``."""
        return require_npu().device_count()

    @staticmethod
    def is_available() -> bool:
        """True when torch_npu imports and sees at least one NPU; never raises."""
        try:
            require_npu()
        except AcceleratorUnavailable:
            return False
        return True

    @staticmethod
    def name() -> str:
        """The name used in ``Trainer(accelerator=...)`` and in the registry."""
        return NPU_DEVICE_TYPE

    @classmethod
    def register_accelerators(cls, accelerator_registry: _AcceleratorRegistry) -> None:
        """Register as ``"npu"``; registering again (or after a reload) replaces the entry."""
        accelerator_registry.register(
            cls.name(), cls, description="Ascend NPU accelerator (torch_npu)", override=True
        )
