"""Linear layers whose weight is reordered once into oneDNN's blocked layout, for the embedded engine's
eager decoding on CPU.

`torch.nn.functional.linear` on a CPU float32 tensor calls MKL's sgemm, which reads the weight in its
plain row-major layout at every call. torch also ships oneDNN's matmul with a weight reordered ahead of
time into the layout its kernels read (`torch.ops.mkldnn._reorder_linear_weight` and
`torch.ops.mkldnn._linear_pointwise`, the ops inductor's CPU weight prepacking uses); vLLM's CPU backend
does the same at load (`dispatch_cpu_unquantized_gemm`, vllm/model_executor/layers/utils.py, vLLM 0.32).
At decode's few rows it is much faster on the 2-core AMD EPYC this was measured on (one thread, SmolLM2's
shapes): [7, 576] x [576, 1536] 134 against 292 µs, [32, 576] x [576, 1536] 521 against 646 µs, the
49,152-word LM head at 32 rows 21 against 39 ms. On that CPU the result of a row did not depend on the
other rows of the call (measured bitwise equal alone and in batches of 5 and 32; again for 1, 5 and 7 rows
of [576, 1536] against a 32-row call, where `F.linear` alone differed by 4.6e-5): a measurement on one
kind of CPU, not a promise of oneDNN, whose kernel choice depends on the machine. It differs
from `F.linear`'s by float reassociation only (4e-6 on outputs of magnitude 1). The rest of a decode step
(attention's batched matmuls) is not batch-invariant either way (dense_runner.py's module docstring).

The reorder is a copy of the weight (the LM head's 49,152 x 576 took 73 ms), done once per weight update
(`pack` in the runner's `refresh`). A compiled decode step keeps `F.linear` (inductor plans its own
kernels), and so does any tensor that is not float32 on a CPU with oneDNN."""

from __future__ import annotations

import torch
import torch.nn.functional as F

ROWS_HINT = 32  # the batch size the layout is chosen for (any number of rows is computed)


def available(weight: torch.Tensor) -> bool:
    """Whether `weight` can be packed: a float32 CPU matrix, with torch's oneDNN ops present."""
    return (weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() == 2
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def pack(weight: torch.Tensor, rows_hint: int = ROWS_HINT) -> torch.Tensor | None:
    """`weight` [out, in] reordered for oneDNN's matmul, or None where it cannot be (`available`)."""
    if not available(weight):
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), rows_hint)


def linear(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
           packed: torch.Tensor | None) -> torch.Tensor:
    """x W^T + b, through `packed` when there is one (then `weight` may be None), else `F.linear`."""
    if packed is None:
        return F.linear(x, weight, bias)
    rows = x.reshape(-1, x.shape[-1])
    out = torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")
    return out.view(*x.shape[:-1], out.shape[-1])
