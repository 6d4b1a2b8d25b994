"""Which GlmMoeDsa models glmlight's GLM-5 fast paths (the engine's runner, the training forward)
reproduce exactly."""

from __future__ import annotations

import torch


def is_glm5(model: torch.nn.Module) -> bool:
    """A GlmMoeDsaForCausalLM with standard RoPE and SiLU (what the engine's runner reproduces)."""
    cfg = getattr(model, "config", None)
    if type(model).__name__ != "GlmMoeDsaForCausalLM" or cfg is None:
        return False
    rope = (getattr(cfg, "rope_parameters", None) or {}).get("rope_type", "default")
    return "dynamic" not in rope and cfg.hidden_act == "silu"
