"""Tensors for SGLang's /update_weights_from_tensor: base64(ForkingPickler(list of (name, tensor))),
what SGLang's `MultiprocessingSerializer.serialize` writes and its `SafeUnpickler` reads
(sglang 0.5.23 srt/utils/common.py); every global such a pickle names is on that allow-list.

- CPU tensors: a copy is moved to a named shared-memory segment (torch's "file_system" sharing
  strategy, `rebuild_storage_filename`), which any process on the same host can open. torch's
  default strategy ("file_descriptor") sends a `multiprocessing.resource_sharer.DupFd`, which a
  separately started server cannot use: fetching the descriptor authenticates with the sender's
  multiprocessing authkey. The segment lives as long as the returned keep-alive object: hold it
  until the server has answered.
- CUDA tensors: CUDA IPC handles whose device (argument 6 of `rebuild_cuda_tensor`) is the
  device's UUID, as SGLang's `monkey_patch_torch_reductions` (srt/utils/patch_torch.py) writes and
  reads it, so the server maps it to its own device index whatever CUDA_VISIBLE_DEVICES it has.
"""

from __future__ import annotations

import base64
import io
import threading
from typing import Any

import torch

_DEVICE_ARG = 6  # rebuild_cuda_tensor(tensor_cls, size, stride, offset, storage_cls, dtype, device, ...)
_strategy_lock = threading.Lock()


def serialize_named_tensors(named: list[tuple[str, torch.Tensor]]) -> tuple[str, Any]:
    """(base64 payload, keep-alive) for one TP rank; see the module docstring."""
    import torch.multiprocessing as tmp
    from multiprocessing.reduction import ForkingPickler

    staged = [(n, t.detach().clone() if t.device.type == "cpu" else t.detach()) for n, t in named]
    buf = io.BytesIO()
    pickler = ForkingPickler(buf)
    pickler.dispatch_table = {**ForkingPickler._extra_reducers, **pickler.dispatch_table}  # type: ignore[attr-defined]
    reduce_tensor = tmp.reductions.reduce_tensor

    def reduce_with_uuid(t: torch.Tensor) -> Any:
        fn, args = reduce_tensor(t)
        if t.is_cuda and isinstance(args[_DEVICE_ARG], int):
            args = (*args[:_DEVICE_ARG], str(torch.cuda.get_device_properties(args[_DEVICE_ARG]).uuid),
                    *args[_DEVICE_ARG + 1:])
        return fn, args

    for cls in (torch.Tensor, torch.nn.parameter.Parameter):
        pickler.dispatch_table[cls] = reduce_with_uuid
    with _strategy_lock:
        before = tmp.get_sharing_strategy()
        tmp.set_sharing_strategy("file_system")
        try:
            pickler.dump(staged)
        finally:
            tmp.set_sharing_strategy(before)
    return base64.b64encode(buf.getvalue()).decode("ascii"), staged
