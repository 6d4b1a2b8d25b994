"""The trainer's weights in the names and layout of a block-FP8 checkpoint (what SGLang's and vLLM's FP8
loaders read), and the `quantization_config` such a checkpoint carries.

A block-FP8 checkpoint (DeepSeek-V3, GLM-5 FP8; `quant_method: fp8`, `weight_block_size: [128, 128]`)
stores every quantised linear weight `P.weight` as float8_e4m3fn plus `P.weight_scale_inv` (float32,
[⌈N/128⌉, ⌈K/128⌉]); everything else as it is. MoE experts are stored one per expert
(`P.experts.{e}.gate_proj.weight`, `up_proj`, `down_proj`, each with its scale), which is what both
servers' MoE loaders map from (vLLM's `DeepseekV2ForCausalLM.load_weights` through
`fused_moe_make_expert_params_mapping`; SGLang's `DeepseekV2WeightLoaderMixin.do_load_weights`
through `FusedMoE.make_expert_params_mapping`); transformers' models hold them fused
(`experts.gate_up_proj` [E, 2I, H], `experts.down_proj` [E, H, I]), so they are split here. Mixtral
checkpoints name them `block_sparse_moe.experts.{e}.w1 / w3 / w2`.

`to_server_weights(named, weight_format, model_path)` is the one call a server client's weight sync
makes before sending: unchanged for `auto`; for `fp8`, the tensors in the layout of the FP8 checkpoint
at `model_path` (the one the server was started with), its block size and ignored modules.
"""

from __future__ import annotations

import json
import os
from typing import Any, Iterable, Sequence

import torch

from glmlight.config.schema import CHOICES
from glmlight.errors import ConfigError
from glmlight.models.fp8 import fp8_splits, quantize_split
from glmlight.ops.quant import BLOCK, quantize_fp8_block

Named = list[tuple[str, torch.Tensor]]

# model_type -> (the MoE block's name in the checkpoint, gate, up, down expert names)
EXPERT_NAMES = {"mixtral": ("block_sparse_moe", "w1", "w3", "w2")}
DEFAULT_EXPERT_NAMES = ("mlp", "gate_proj", "up_proj", "down_proj")


def fp8_quantization_config(block: Sequence[int] = BLOCK, modules_to_not_convert: Sequence[str] = ()) -> dict[str, Any]:
    """The `quantization_config` of a block-FP8 checkpoint's config.json (as DeepSeek-V3's; both servers
    read `quant_method`, `activation_scheme`, `weight_block_size` and `modules_to_not_convert`)."""
    cfg: dict[str, Any] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                           "weight_block_size": [int(block[0]), int(block[1])]}
    if modules_to_not_convert:
        cfg["modules_to_not_convert"] = list(modules_to_not_convert)
    return cfg


def read_quantization(config: dict[str, Any], where: str = "the checkpoint") -> tuple[tuple[int, int], list[str]]:
    """(block, ignored modules) of a block-FP8 config.json dict; one clear error for anything else."""
    q = config.get("quantization_config") or {}
    if q.get("quant_method") != "fp8" or not q.get("weight_block_size"):
        raise ConfigError(f"config error: rollout.weight_format=fp8 needs the server to run a block-FP8 checkpoint "
                          f"(quantization_config.quant_method=fp8 with weight_block_size); {where} has "
                          f"{q or 'no quantization_config'} (write one with scripts/export.py CKPT OUT --fp8)")
    block = tuple(int(b) for b in q["weight_block_size"])
    if len(block) != 2:
        raise ConfigError(f"config error: {where}: weight_block_size must be [rows, cols], got {q['weight_block_size']}")
    ignored = list(q.get("ignored_layers") or q.get("modules_to_not_convert") or [])
    return block, ignored  # type: ignore[return-value]


def fp8_checkpoint_tensors(named: Iterable[tuple[str, torch.Tensor]], *, block: Sequence[int] = BLOCK,
                           ignored: Sequence[str] = (), model_type: str | None = None,
                           dtype: torch.dtype | None = None) -> Named:
    """The trainer's named tensors (transformers' names) as a block-FP8 checkpoint holds them: quantised
    weights as (`P.weight` float8_e4m3fn, `P.weight_scale_inv` float32), fused experts split per expert
    (see the module docstring), the rest unchanged (cast to `dtype` when given). Pure: no model needed."""
    block = (int(block[0]), int(block[1]))
    moe, gate, up, down = EXPERT_NAMES.get(model_type or "", DEFAULT_EXPERT_NAMES)
    out: Named = []
    for name, t in named:
        t = t.detach()
        splits = fp8_splits(name, t.shape, ignored)
        if moe != "mlp":  # Mixtral: every MLP is the MoE block
            name = name.replace(".mlp.", f".{moe}.")
        if splits == 0:
            out.append((name, t.to(dtype) if dtype is not None and t.is_floating_point() else t))
        elif t.dim() == 2:
            q, s = quantize_fp8_block(t, block)
            out += [(name, q), (name + "_scale_inv", s)]
        else:  # fused experts [E, rows, cols]
            prefix, fused = name.rsplit(".experts.", 1)
            q, s = quantize_split(t, splits, block)
            parts = [gate, up] if fused == "gate_up_proj" else [down]
            for e in range(t.shape[0]):
                for part, qe, se in zip(parts, q[e].chunk(len(parts), dim=0), s[e].chunk(len(parts), dim=0)):
                    base = f"{prefix}.experts.{e}.{part}.weight"
                    out += [(base, qe.contiguous()), (base + "_scale_inv", se.contiguous())]
    return out


def server_quantization(model_path: str) -> tuple[tuple[int, int], list[str], str | None]:
    """(block, ignored modules, model_type) of the FP8 checkpoint at `model_path` (its config.json)."""
    path = os.path.join(model_path, "config.json")
    if not os.path.isfile(path):
        raise ConfigError(f"config error: rollout.weight_format=fp8 needs the server's checkpoint config: "
                          f"{path} does not exist (set rollout.server.model_path)")
    with open(path) as f:
        config = json.load(f)
    block, ignored = read_quantization(config, where=model_path)
    return block, ignored, config.get("model_type")


def to_server_weights(named: Iterable[tuple[str, torch.Tensor]], weight_format: str,
                      model_path: str | None) -> Iterable[tuple[str, torch.Tensor]]:
    """What a server client sends for `rollout.weight_format`: `named` unchanged for "auto"; for "fp8"
    the block-FP8 checkpoint layout of the checkpoint at `model_path` (`fp8_checkpoint_tensors`)."""
    if weight_format == "auto":
        return named
    if weight_format != "fp8":
        raise ConfigError(f"config error: rollout.weight_format={weight_format!r} is not one of "
                          f"{list(CHOICES['rollout.weight_format'])}")
    if not model_path:
        raise ConfigError("config error: rollout.weight_format=fp8 needs rollout.server.model_path (or model.path): "
                          "the FP8 checkpoint the server runs")
    block, ignored, model_type = server_quantization(model_path)
    return fp8_checkpoint_tensors(named, block=block, ignored=ignored, model_type=model_type)
