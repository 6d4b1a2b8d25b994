"""A CPU stand-in for ``torch_npu`` (Huawei's PyTorch adapter for Ascend NPUs), for tests.

Tests put ``tests/support/npu_standin`` on ``sys.path`` so ``import torch_npu`` finds this
package, and call `uninstall` afterwards. Every ``torch.npu`` call is appended to
`calls` (``(name, *args)``), so a test can see which of torch_npu's functions the
plugin used.

What is real and what is stood in:

- Real: PyTorch (CPU), Lightning, the plugin's own code, gloo collectives, and the
  ``torch.distributed`` backend registry through which the name ``"hccl"`` is
  registered (as torch_npu registers it, with ``Backend.register_backend``).
- Stood in: ``torch.npu`` (device count, set_device, memory_stats, ... each in
  the `torch_npu.npu` module torch_npu defines it in, with its parameters; all on
  CPU and recorded); the HCCL process group is a gloo process group created under
  the backend name ``"hccl"`` for CPU tensors, registered with the calling
  convention torch_npu uses (``extended_api=True``: the creator gets torch's
  backend options), each creation recorded as ``("hccl_process_group", rank, size)``.
- Stand-in only: the names in ``__standin_only__`` (the call log, `install`,
  `uninstall`, the device-type redirect); everything else the stand-in defines
  exists in torch_npu (tests/unit/accelerators/test_npu_wheels.py checks it against the wheel).
- Not possible on CPU PyTorch: tensors on a device of type ``"npu"``. torch_npu
  gets it by renaming PyTorch's PrivateUse1 backend to "npu" and implementing
  every ATen kernel in C++. A Python-only rename works
  (``torch.utils.backend_registration._setup_privateuseone_for_python_backend``),
  but every operator (``empty_strided`` first) still needs a kernel, and the
  rename is permanent for the process (a second rename raises), so it would leak
  into every other test. The stand-in therefore redirects the plugin's one device
  indirection, ``glmlight.accelerators.npu.device_type``, to `cpu_device_type`:
  ``npu:i`` becomes ``cpu:i`` and ``autocast("npu")`` becomes ``autocast("cpu")``,
  and each redirect is recorded as ``("device_type", "npu->cpu")``.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist

from torch_npu import npu
from torch_npu._record import calls, names, record

__version__ = "0.0.0+standin"
IS_STANDIN = True

__all__ = ["calls", "cpu_device_type", "install", "names", "npu", "npu_fusion_attention", "record", "uninstall"]
__standin_only__ = ("IS_STANDIN", "calls", "cpu_device_type", "install", "names", "record", "uninstall")

_added: dict[str, bool] = {"torch.npu": False, "hccl": False, "HCCL_attr": False}


def cpu_device_type() -> str:
    """Replacement for ``glmlight.accelerators.npu.device_type``: NPU devices become CPU devices."""
    record("device_type", "npu->cpu")
    return "cpu"


def npu_fusion_attention(query, key, value, head_num, input_layout, pse=None, padding_mask=None, atten_mask=None,
                         scale=1., keep_prob=1., pre_tockens=2147483647, next_tockens=2147483647, inner_precise=0,
                         prefix=None, actual_seq_qlen=None, actual_seq_kvlen=None, sparse_mode=0,
                         gen_mask_parallel=True, sync=False, softmax_layout=""):
    """torch_npu's fused attention operator (exported from ``torch.ops.npu``). transformers imports it
    whenever torch_npu is importable; glmlight's models never call it, and the stand-in has no kernel."""
    raise NotImplementedError("the torch_npu stand-in has no fused attention kernel")


def _hccl_process_group(dist_backend_opts: Any, pg_options: Any) -> Any:
    """What ``init_process_group("hccl")`` creates here: a gloo process group for CPU tensors. Called as
    torch calls torch_npu's creator (``extended_api=True``): torch's ``_DistributedBackendOptions``
    (store, group_rank, group_size, timeout, ...) and the backend's options."""
    opts = dist_backend_opts
    record("hccl_process_group", opts.group_rank, opts.group_size)
    return dist.ProcessGroupGloo(opts.store, opts.group_rank, opts.group_size, opts.timeout)


def _register_hccl() -> None:
    if not dist.is_available() or "hccl" in dist.Backend.backend_list:
        return
    _added["HCCL_attr"] = not hasattr(dist.Backend, "HCCL")
    dist.Backend.register_backend("hccl", _hccl_process_group, extended_api=True, devices=["cpu"])
    _added["hccl"] = True


def _unregister_hccl() -> None:
    """Undo `_register_hccl` (torch has no public unregister; these are the tables it filled)."""
    if not _added["hccl"]:
        return
    backend = dist.Backend
    if "hccl" in backend.backend_list:
        backend.backend_list.remove("hccl")
    backend.backend_type_map.pop("hccl", None)
    backend.backend_capability.pop("hccl", None)
    backend._plugins.pop("HCCL", None)
    if _added["HCCL_attr"] and hasattr(backend, "HCCL"):
        delattr(backend, "HCCL")
    _added["hccl"] = _added["HCCL_attr"] = False


def install() -> None:
    """Do what ``import torch_npu`` does that matters here: ``torch.npu`` and the hccl backend."""
    if getattr(torch, "npu", None) is not npu:
        torch.npu = npu  # type: ignore[attr-defined]
        sys.modules["torch.npu"] = npu
        _added["torch.npu"] = True
    _register_hccl()


def uninstall() -> None:
    """Remove ``torch.npu`` and the hccl backend again, and forget the recorded calls."""
    if _added["torch.npu"]:
        if getattr(torch, "npu", None) is npu:
            delattr(torch, "npu")
        if sys.modules.get("torch.npu") is npu:
            del sys.modules["torch.npu"]
        _added["torch.npu"] = False
    _unregister_hccl()
    npu.utils._reset()
    calls.clear()


install()
