"""Checks the vLLM worker extension (vllm_extension.py) makes of an update before it loads it: the served
checkpoint's names and shapes, read from its safetensors headers. Imports torch and safetensors only."""

from __future__ import annotations

import os

import torch
from safetensors import safe_open

# Names a trainer may send that a served checkpoint legitimately lacks (load_weights skips them).
IGNORABLE_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


def check_update_names(named: list[tuple[str, torch.Tensor]], want: dict[str, tuple[int, ...]]) -> None:
    """Every tensor of the served checkpoint, nothing unknown, the right shapes: layerwise reload
    re-materialises whole layers, so a layer that got only part of its tensors would serve
    uninitialised memory."""
    if not want:
        return
    got: dict[str, tuple[int, ...]] = {}
    for name, t in named:
        for n, shape in _expanded(name, tuple(t.shape), want):
            if n in got:
                raise ValueError(f"tensor {n!r} sent twice in one update")
            got[n] = shape
    unknown = sorted(n for n in got if n not in want and not n.endswith(IGNORABLE_SUFFIXES)
                     and not (n == "lm_head.weight" and "model.embed_tokens.weight" in want))
    if unknown:
        raise ValueError(f"{len(unknown)} tensors the served model does not have, e.g. {unknown[:3]}")
    bad = [(n, got[n], want[n]) for n in got if n in want and got[n] != want[n]]
    if bad:
        raise ValueError(f"{len(bad)} tensors of the wrong shape (name, sent, served), e.g. {bad[:2]}")
    missing = sorted(set(want) - set(got))
    if missing:
        raise ValueError(f"the update lacks {len(missing)} of the served model's {len(want)} tensors, "
                         f"e.g. {missing[:3]}")


def checkpoint_shapes(path: str) -> dict[str, tuple[int, ...]]:
    """Names and shapes of a safetensors checkpoint (a directory or one file), from the headers."""
    files = ([os.path.join(path, f) for f in sorted(os.listdir(path)) if f.endswith(".safetensors")]
             if os.path.isdir(path) else [path])
    out: dict[str, tuple[int, ...]] = {}
    for f in files:
        with safe_open(f, framework="pt") as st:
            for k in st.keys():
                out[k] = tuple(st.get_slice(k).get_shape())
    return out


def _expanded(name: str, shape: tuple[int, ...], want: dict) -> list[tuple[str, tuple[int, ...]]]:
    """transformers 5 keeps MoE experts fused in memory (`...experts.gate_up_proj` [E, 2I, H],
    `...experts.down_proj` [E, H, I]); checkpoints hold `...experts.{e}.{gate,up,down}_proj.weight`.
    vLLM's MoE `load_weights` takes both; for the check, a fused name stands for its per-expert ones."""
    if name in want or len(shape) != 3:
        return [(name, shape)]
    for fused, parts in ((".experts.gate_up_proj", ("gate_proj", "up_proj")), (".experts.down_proj", ("down_proj",))):
        if name.endswith(fused):
            prefix = name[: -len(fused)] + ".experts"
            if f"{prefix}.0.{parts[0]}.weight" not in want:
                break
            experts, rows, cols = shape
            return [(f"{prefix}.{e}.{p}.weight", (rows // len(parts), cols)) for e in range(experts) for p in parts]
    return [(name, shape)]
