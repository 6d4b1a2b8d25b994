"""The embedded default: a tiny, randomly initialised GLM-5 (GlmMoeDsa) model.

Same architecture as GLM-5 (MLA attention, DSA indexer, MoE with shared expert and
sigmoid router), only small. Sizes are presets; any field can be overridden.
"""

from __future__ import annotations

from typing import Any

from transformers import GlmMoeDsaConfig

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
