"""FP8 weights: which of a model's tensors are block-quantised, and a model that holds them so.

Which tensors (the layout of DeepSeek-V3's and GLM-5's FP8 checkpoints, and the layers SGLang's and
vLLM's model code build with the FP8 quantisation config): the 2-D weights of the linear layers of the
decoder layers (`*.layers.N.*`: attention projections, the DSA indexer's `wq_b` and `wk`, dense and
shared-expert MLPs) and the fused expert weights of MoE layers (`experts.gate_up_proj` [E, 2I, H],
quantised per expert with the gate and up halves in blocks of their own, as the checkpoints store them
separately; `experts.down_proj` [E, H, I]). Never: embeddings, the LM head, norms, biases, MoE routers
(`gate`, `shared_expert_gate`) and the DSA indexer's `weights_proj` (bf16 in those checkpoints; both
servers build it unquantised), an MTP layer's `eh_proj` and its copies of the embedding and head
(`glmlight.models.mtp`; MTP layers are decoder layers here too, `mtp.layers.N.*` or `model.layers.N.*`), plus
any module the checkpoint's `modules_to_not_convert` / `ignored_layers` names.

`hold_fp8_(model)` turns a model, in place, into one that holds those weights as float8_e4m3fn with
their `weight_scale_inv` and dequantises them whenever they are read (weight-only FP8: the matmul
sees Q·s in the model's dtype). Each weight becomes a `torch.nn.utils.parametrize` parametrization,
so the model's own forward, and any code that reads `module.weight`, gets the dequantised tensor.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Sequence

import torch
from torch.nn.utils import parametrize

from glmlight.errors import EngineError
from glmlight.ops.quant import BLOCK, dequantize_fp8_block, quantize_fp8_block

log = logging.getLogger(__name__)

# Modules (last name component) never quantised: MoE routers and the DSA indexer's head weights; in MTP layers
# (glmlight.models.mtp) the projection `eh_proj` (both servers build it as a plain nn.Linear) and a checkpoint's
# per-layer copies of the embedding and output head (`embed_tokens`, `shared_head.head`).
UNQUANTIZED_MODULES = ("gate", "shared_expert_gate", "weights_proj", "eh_proj", "embed_tokens", "head")
FUSED_EXPERTS = {"gate_up_proj": 2, "down_proj": 1}  # fused expert tensor -> row splits (gate | up)
_LAYER = re.compile(r"(^|\.)layers\.\d+\.")


def _ignored(module: str, ignored: Sequence[str]) -> bool:
    """`module` is named by `ignored`: exactly, or as a suffix at a name boundary ("lm_head",
    "mlp.gate", "model.layers.0.self_attn.q_proj")."""
    return any(module == m or module.endswith("." + m) for m in ignored)


def fp8_splits(name: str, shape: Sequence[int], ignored: Sequence[str] = ()) -> int:
    """How a tensor of the model is block-quantised: 0 = not at all; k >= 1 = in k row groups of
    their own (2 for a fused gate|up expert tensor, else 1). See the module docstring."""
    if not _LAYER.search(name):
        return 0
    parts = name.split(".")
    if len(shape) == 3 and parts[-2] == "experts" and parts[-1] in FUSED_EXPERTS:
        return 0 if _ignored(".".join(parts[:-1]), ignored) else FUSED_EXPERTS[parts[-1]]
    if len(shape) != 2 or parts[-1] != "weight" or len(parts) < 2:
        return 0
    module = ".".join(parts[:-1])
    if parts[-2] in UNQUANTIZED_MODULES or _ignored(module, ignored):
        return 0
    return 1


def quantize_split(w: torch.Tensor, splits: int, block: tuple[int, int] = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_fp8_block` over `splits` equal row groups of w [..., N, K], each in blocks of its own;
    Q and the scales are concatenated back along the rows."""
    if splits == 1:
        return quantize_fp8_block(w, block)
    qs, ss = zip(*(quantize_fp8_block(part, block) for part in w.chunk(splits, dim=-2)))
    return torch.cat(qs, dim=-2), torch.cat(ss, dim=-2)


def dequantize_split(q: torch.Tensor, scale_inv: torch.Tensor, splits: int, block: tuple[int, int] = BLOCK,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The inverse of `quantize_split`."""
    if splits == 1:
        return dequantize_fp8_block(q, scale_inv, block, dtype)
    return torch.cat([dequantize_fp8_block(a, b, block, dtype)
                      for a, b in zip(q.chunk(splits, dim=-2), scale_inv.chunk(splits, dim=-2))], dim=-2)


class BlockFp8(torch.nn.Module):
    """Parametrization: the stored float8_e4m3fn tensor -> Q·s in `dtype` (read as the weight)."""

    def __init__(self, scale_inv: torch.Tensor, dtype: torch.dtype, splits: int = 1, block: tuple[int, int] = BLOCK):
        super().__init__()
        self.register_buffer("weight_scale_inv", scale_inv)
        self.dtype, self.splits, self.block = dtype, splits, block

    def forward(self, q: torch.Tensor) -> torch.Tensor:
        return dequantize_split(q, self.weight_scale_inv, self.splits, self.block, self.dtype)


@dataclass
class Fp8Weight:
    """One FP8-held weight of a model: `module.<attr>` reads its dequantised value."""

    module: torch.nn.Module
    attr: str
    splits: int

    @property
    def parametrization(self) -> BlockFp8:
        return self.module.parametrizations[self.attr][0]

    @property
    def stored(self) -> torch.Tensor:
        """The float8_e4m3fn tensor."""
        return self.module.parametrizations[self.attr].original

    @torch.no_grad()
    def load_(self, w: torch.Tensor) -> None:
        """Quantise `w` (the trainer's weight, any float dtype) into this weight, in place."""
        p = self.parametrization
        q, s = quantize_split(w.to(self.stored.device), self.splits, p.block)
        self.stored.copy_(q)
        p.weight_scale_inv.copy_(s)


@torch.no_grad()
def hold_fp8_(model: torch.nn.Module, *, ignored: Sequence[str] = (), block: tuple[int, int] = BLOCK,
              dtype: torch.dtype | None = None) -> dict[str, Fp8Weight]:
    """Hold the FP8 weights of `model` (see the module docstring) as float8_e4m3fn + weight_scale_inv,
    dequantised to `dtype` (default: each weight's own dtype) when read. Returns them by their
    names in the model's state dict before the change (the trainer's names)."""
    found: dict[str, Fp8Weight] = {}
    for name, p in list(model.named_parameters()):
        splits = fp8_splits(name, p.shape, ignored)
        if not splits:
            continue
        path, attr = name.rsplit(".", 1)
        module = model.get_submodule(path)
        q, s = quantize_split(p.detach(), splits, block)
        out_dtype = dtype or p.dtype
        # the stored tensor replaces the float one; the parametrization reads it back as Q·s
        setattr(module, attr, torch.nn.Parameter(q, requires_grad=False))
        parametrize.register_parametrization(module, attr, BlockFp8(s, out_dtype, splits, block), unsafe=True)
        found[name] = Fp8Weight(module, attr, splits)
    return found


def hold_for_engine(model: torch.nn.Module, weight_format: str, dtype: torch.dtype) -> dict[str, Fp8Weight]:
    """An engine's `weight_format`: "auto" holds nothing in FP8 (returns {}); "fp8" holds the model's
    FP8 weights (`hold_fp8_`), computed in `dtype`, and returns them by the trainer's names."""
    if weight_format not in ("auto", "fp8"):
        raise ValueError(f"weight_format must be 'auto' or 'fp8', got {weight_format!r}")
    if weight_format == "auto":
        return {}
    held = hold_fp8_(model, dtype=dtype)
    if not held:
        raise EngineError(f"weight_format='fp8': {type(model).__name__} has no decoder-layer linear weights to quantise")
    log.info("engine: %d weights held as block FP8 (float8_e4m3fn, 128 x 128 scales), computed in %s",
             len(held), dtype)
    return held
