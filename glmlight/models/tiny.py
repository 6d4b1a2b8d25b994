"""The embedded default: a tiny, randomly initialised GLM model.

`arch` picks the architecture (`model.arch`), each with the structure of its real config, only small:

- `glm5` (the default): GLM-5's GlmMoeDsa (MLA attention, DSA indexer, MoE with a shared expert and a
  sigmoid router);
- `glm4moe`: GLM-4.5/4.6/4.7's Glm4Moe (grouped-query attention with heads wider than hidden / heads,
  half-rotary RoPE, q/k/v biases and per-head q/k norms as GLM-4.5's config.json has them, a dense first
  layer, then MoE layers with one shared expert and a sigmoid router with its correction bias,
  `routed_scaling_factor` 2.5 and normalised top-k weights);
- `glm4moe_lite`: GLM-4.7-Flash's Glm4MoeLite (MLA attention with interleaved RoPE, a dense first layer,
  MoE, `routed_scaling_factor` 1.8).

Sizes are presets; any field can be overridden.
"""

from __future__ import annotations

from typing import Any

from transformers import Glm4MoeConfig, Glm4MoeLiteConfig, GlmMoeDsaConfig, PretrainedConfig

PRESETS: dict[str, dict[str, Any]] = {
    # ~0.3M parameters: unit tests.
    "test": dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
                 num_attention_heads=4, n_routed_experts=4, num_experts_per_tok=2,
                 kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                 index_topk=64, index_head_dim=16, index_n_heads=2),
    # ~1.5M parameters: the default run (learns small arithmetic on 2 CPU cores).
    "tiny": dict(hidden_size=128, intermediate_size=384, moe_intermediate_size=96, num_hidden_layers=3,
                 num_attention_heads=4, n_routed_experts=4, num_experts_per_tok=2,
                 kv_lora_rank=32, q_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=32,
                 index_topk=32, index_head_dim=32, index_n_heads=2),
    # ~50M parameters: benchmarks.
    "small": dict(hidden_size=512, intermediate_size=1536, moe_intermediate_size=384, num_hidden_layers=8,
                  num_attention_heads=8, n_routed_experts=8, num_experts_per_tok=2,
                  kv_lora_rank=128, q_lora_rank=256, qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=64,
                  index_topk=64, index_head_dim=64, index_n_heads=4),
}


# The other GLM architectures at the same presets' sizes (the attention's own shape per architecture).
GLM4MOE_PRESETS: dict[str, dict[str, Any]] = {
    "test": dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32, n_routed_experts=4, num_experts_per_tok=2),
    "tiny": dict(hidden_size=128, intermediate_size=384, moe_intermediate_size=96, num_hidden_layers=3,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=64, n_routed_experts=4, num_experts_per_tok=2),
    "small": dict(hidden_size=512, intermediate_size=1536, moe_intermediate_size=384, num_hidden_layers=8,
                  num_attention_heads=8, num_key_value_heads=2, head_dim=128, n_routed_experts=8,
                  num_experts_per_tok=2),
}
GLM4MOE_LITE_PRESETS: dict[str, dict[str, Any]] = {
    name: dict(hidden_size=p["hidden_size"], intermediate_size=p["intermediate_size"],
               moe_intermediate_size=p["moe_intermediate_size"], num_hidden_layers=p["num_hidden_layers"],
               num_attention_heads=p["num_attention_heads"], n_routed_experts=p["n_routed_experts"],
               num_experts_per_tok=p["num_experts_per_tok"], kv_lora_rank=p["kv_lora_rank"],
               q_lora_rank=p["q_lora_rank"], qk_rope_head_dim=p["qk_rope_head_dim"],
               qk_nope_head_dim=p["qk_nope_head_dim"], v_head_dim=p["v_head_dim"])
    for name, p in PRESETS.items()
}
ARCHES = ("glm5", "glm4moe", "glm4moe_lite")


def tiny_config(arch: str, vocab_size: int, preset: str = "tiny", pad_token_id: int = 0, eos_token_id: int = 1,
                max_position_embeddings: int = 2048, **overrides: Any) -> PretrainedConfig:
    """The config of a tiny `arch` model (one of ARCHES) at `preset`'s size; `overrides` are config keys
    (`index_topk` applies to GLM-5 only and is dropped for the others)."""
    if arch == "glm5":
        return tiny_glm5_config(vocab_size, preset, pad_token_id, eos_token_id, max_position_embeddings, **overrides)
    if arch not in ARCHES:
        raise ValueError(f"unknown tiny model architecture {arch!r}; choose one of {list(ARCHES)}")
    if preset not in PRESETS:
        raise ValueError(f"unknown tiny model preset {preset!r}; choose one of {sorted(PRESETS)}")
    overrides.pop("index_topk", None)
    common = dict(vocab_size=vocab_size, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
                  norm_topk_prob=True, max_position_embeddings=max_position_embeddings, pad_token_id=pad_token_id,
                  bos_token_id=None, eos_token_id=eos_token_id, tie_word_embeddings=False)
    if arch == "glm4moe":
        return Glm4MoeConfig(**{**common, **GLM4MOE_PRESETS[preset], **overrides}, partial_rotary_factor=0.5,
                             attention_bias=True, use_qk_norm=True, routed_scaling_factor=2.5)
    return Glm4MoeLiteConfig(**{**common, **GLM4MOE_LITE_PRESETS[preset], **overrides},
                             num_key_value_heads=GLM4MOE_LITE_PRESETS[preset]["num_attention_heads"],
                             routed_scaling_factor=1.8, rope_interleave=True)


def tiny_glm5_config(vocab_size: int, preset: str = "tiny", pad_token_id: int = 0, eos_token_id: int = 1,
                     max_position_embeddings: int = 2048, **overrides: Any) -> GlmMoeDsaConfig:
    if preset not in PRESETS:
        raise ValueError(f"unknown tiny model preset {preset!r}; choose one of {sorted(PRESETS)}")
    kw = dict(PRESETS[preset])
    kw.update(overrides)
    kw.setdefault("num_key_value_heads", kw["num_attention_heads"])
    kw["head_dim"] = kw["qk_rope_head_dim"]
    return GlmMoeDsaConfig(
        vocab_size=vocab_size,
        n_shared_experts=1,
        first_k_dense_replace=1,
        max_position_embeddings=max_position_embeddings,
        pad_token_id=pad_token_id,
        bos_token_id=None,
        eos_token_id=eos_token_id,
        tie_word_embeddings=False,
        **kw,
    )
