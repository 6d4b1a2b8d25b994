"""Block-wise FP8 weight quantisation: float8_e4m3fn values with one scale per 128 x 128 block.

The layout of DeepSeek-V3's and GLM-5's FP8 checkpoints (DeepSeek-V3, arXiv:2412.19437 §3.3.2: weights
quantised per 128 x 128 block with its own scale): for a weight W [N, K] (or a stack [..., N, K]),

    s[i, j] = max(max |W[block i, j]| / 448, 2^-126)     (448 = the largest float8_e4m3fn value)
    Q       = float8_e4m3fn(W / s)                         (round to nearest, |W / s| <= 448)
    W ≈ Q · s                                              (`weight_scale_inv` is s, shape [⌈N/128⌉, ⌈K/128⌉])

The last block row and column may be partial (N or K not a multiple of 128): they are scaled by the
largest value they hold. `weight_scale_inv` is float32. A block whose largest magnitude is below
448 · 2^-126 would get a scale that underflows to 0 (then 0 / 0) or is subnormal: its scale is clamped
at the smallest normal float32, 2^-126 (such a block quantises to zeros and subnormal steps). An
all-zero block gets the scale 1.

Round-trip error: e4m3 keeps 3 mantissa bits, so a value whose scaled magnitude |W/s| is at least the
smallest normal 2^-6 is off by at most half a step, 2^-4 of its magnitude; below that the steps are
the subnormal spacing 2^-9, so the error is at most 2^-10 · s. Per element:

    |W - Q·s| <= max(2^-4 · |W|, 2^-10 · s)

The largest element of every block maps to ±448 and comes back as 448 · fl(amax / 448): within one
float32 ulp of itself, not always exactly, because the scale is rounded to float32.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
BLOCK = (128, 128)


def fp8_scale_shape(shape: tuple[int, ...] | torch.Size, block: tuple[int, int] = BLOCK) -> tuple[int, ...]:
    """The `weight_scale_inv` shape of a weight of `shape` [..., N, K]: [..., ⌈N/bn⌉, ⌈K/bk⌉]."""
    *lead, n, k = shape
    return (*lead, -(-n // block[0]), -(-k // block[1]))


def _blocks(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """x [..., N, K] zero-padded to whole blocks and viewed as [..., N/bn, bn, K/bk, bk]."""
    *lead, n, k = x.shape
    bn, bk = block
    pn, pk = -n % bn, -k % bk
    if pn or pk:
        x = torch.nn.functional.pad(x, (0, pk, 0, pn))
    return x.reshape(*lead, (n + pn) // bn, bn, (k + pk) // bk, bk)


def _expand(scale: torch.Tensor, shape: torch.Size, block: tuple[int, int]) -> torch.Tensor:
    """scale [..., ⌈N/bn⌉, ⌈K/bk⌉] repeated over its blocks and cut to [..., N, K]."""
    n, k = shape[-2], shape[-1]
    return scale.repeat_interleave(block[0], dim=-2)[..., :n, :].repeat_interleave(block[1], dim=-1)[..., :k]


@torch.no_grad()
def quantize_fp8_block(w: torch.Tensor, block: tuple[int, int] = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(Q float8_e4m3fn [..., N, K], weight_scale_inv float32 [..., ⌈N/bn⌉, ⌈K/bk⌉]) of w [..., N, K]
    (see the module docstring). An all-zero block gets a scale of 1 and zeros."""
    if w.dim() < 2:
        raise ValueError(f"block FP8 quantisation needs a [..., N, K] weight, got shape {tuple(w.shape)}")
    if not w.is_floating_point():
        raise ValueError(f"block FP8 quantisation needs a floating-point weight, got {w.dtype}")
    wf = w.float()
    amax = _blocks(wf.abs(), block).amax(dim=(-3, -1))  # [..., N/bn, K/bk]
    tiny = torch.finfo(torch.float32).tiny
    scale = torch.where(amax > 0, (amax / FP8_MAX).clamp(min=tiny), torch.ones_like(amax))
    q = (wf / _expand(scale, w.shape, block)).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def dequantize_fp8_block(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = BLOCK,
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Q · s in `dtype` (the product in float32, rounded once): the inverse of `quantize_fp8_block`."""
    if tuple(scale_inv.shape) != fp8_scale_shape(q.shape, block):
        raise ValueError(f"weight_scale_inv of shape {tuple(scale_inv.shape)} does not fit a weight of shape "
                         f"{tuple(q.shape)} in {block[0]} x {block[1]} blocks "
                         f"(expected {fp8_scale_shape(q.shape, block)})")
    return (q.float() * _expand(scale_inv.float(), q.shape, block)).to(dtype)


def fp8_error_bound(w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = BLOCK) -> torch.Tensor:
    """The per-element bound max(2^-4 · |w|, 2^-10 · s) on |w - dequantize(quantize(w))|."""
    s = _expand(scale_inv.float(), w.shape, block)
    return torch.maximum(w.float().abs() * 2.0**-4, s * 2.0**-10)
