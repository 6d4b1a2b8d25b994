"""Which GLM models glmlight's fast paths reproduce exactly: GLM-5 (GlmMoeDsa: the engine's GLM-5 runner and
the training forward), GLM-4.7-Flash (Glm4MoeLite: the same MLA attention and MoE without the DSA indexer, on
the GLM-5 runner) and GLM-4.5 / 4.6 / 4.7 (Glm4Moe: grouped-query attention and the same MoE, on the dense
runner)."""

from __future__ import annotations

import torch


def _standard_rope_silu(cfg) -> bool:
    rope = (getattr(cfg, "rope_parameters", None) or {}).get("rope_type", "default")
    return "dynamic" not in rope and cfg.hidden_act == "silu"


def is_glm5(model: torch.nn.Module) -> bool:
    """A GlmMoeDsaForCausalLM with standard RoPE and SiLU (what the engine's runner reproduces)."""
    cfg = getattr(model, "config", None)
    if type(model).__name__ != "GlmMoeDsaForCausalLM" or cfg is None:
        return False
    return _standard_rope_silu(cfg)


def glm4_moe_lite_unsupported(model: torch.nn.Module) -> str | None:
    """Why the GLM-5 runner cannot reproduce a Glm4MoeLiteForCausalLM (None: it can): it needs the low-rank
    query (`q_lora_rank`), RoPE over the whole rotary head (`partial_rotary_factor` 1), standard RoPE, SiLU."""
    cfg = model.config
    if not _standard_rope_silu(cfg):
        return "dynamic RoPE or an activation other than silu"
    if getattr(cfg, "q_lora_rank", None) is None:
        return "q_lora_rank=null (a full-rank query projection)"
    if model.model.rotary_emb.inv_freq.numel() * 2 != cfg.qk_rope_head_dim:
        return "a partial_rotary_factor below 1 of qk_rope_head_dim"
    return None


def is_glm4_moe_lite(model: torch.nn.Module) -> bool:
    """A Glm4MoeLiteForCausalLM (GLM-4.7-Flash) the GLM-5 runner reproduces."""
    return type(model).__name__ == "Glm4MoeLiteForCausalLM" and getattr(model, "config", None) is not None \
        and glm4_moe_lite_unsupported(model) is None

