"""Dtype names: the config's spellings and the names weight transports send over the wire."""

from __future__ import annotations

import torch

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16, "float64": torch.float64}


def resolve_dtype(name: str | torch.dtype) -> torch.dtype:
    """A config dtype name (`float32`, `bf16`, ...) or a torch.dtype, as a torch.dtype."""
    if isinstance(name, torch.dtype):
        return name
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(DTYPES)}") from None


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> "bfloat16" (the spelling SGLang and vLLM use in update requests)."""
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    """The inverse of `dtype_name` (any torch dtype attribute, e.g. "float8_e4m3fn")."""
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype
