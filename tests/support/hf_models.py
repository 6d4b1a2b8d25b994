"""Tiny transformers checkpoints built locally (random weights, glmlight's character tokenizer), for
`model=hf model.path=...` runs of architectures other than GLM-5."""

from __future__ import annotations

import os

import torch


def _configs(tok):
    import transformers as T

    common = dict(vocab_size=len(tok), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                  bos_token_id=None, max_position_embeddings=512, tie_word_embeddings=False)
    return {
        # dense; q, k, v and gate multiples of 128 rows so that a block-FP8 vLLM could load it too
        "llama": (T.LlamaConfig, T.LlamaForCausalLM,
                  dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=4, head_dim=32, **common)),
        "qwen3": (T.Qwen3Config, T.Qwen3ForCausalLM,
                  dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, **common)),
        "qwen3_moe": (T.Qwen3MoeConfig, T.Qwen3MoeForCausalLM,
                      dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
                           num_experts_per_tok=2, norm_topk_prob=True, **common)),
        "deepseek_v3": (T.DeepseekV3Config, T.DeepseekV3ForCausalLM,
                        dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2,
                             n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
                             kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                             rope_interleave=True, **common)),
        # GLM-4.5 / 4.6 / 4.7's structure: grouped-query attention whose heads are wider than hidden / heads,
        # half-rotary RoPE, q/k/v biases, per-head q/k norms, dense first layer(s), then MoE layers with one
        # shared expert and a sigmoid router (correction bias, scaled weights; two expert groups of which the best
        # is used, where GLM-4.5 has one group, so that the group-limited choice runs)
        "glm4_moe": (T.Glm4MoeConfig, T.Glm4MoeForCausalLM,
                     dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=32, partial_rotary_factor=0.5,
                          attention_bias=True, use_qk_norm=True, first_k_dense_replace=1, n_routed_experts=8,
                          num_experts_per_tok=2, n_shared_experts=1, n_group=2, topk_group=1,
                          routed_scaling_factor=2.5, norm_topk_prob=True, **common)),
        # GLM-4.7-Flash's structure: MLA attention (q and kv low-rank, interleaved RoPE), dense first layer, MoE
        "glm4_moe_lite": (T.Glm4MoeLiteConfig, T.Glm4MoeLiteForCausalLM,
                          dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
                               num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
                               num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1,
                               routed_scaling_factor=1.8, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8,
                               qk_nope_head_dim=8, v_head_dim=16, rope_interleave=True, **common)),
    }


ARCHITECTURES = ("llama", "qwen3", "qwen3_moe", "deepseek_v3", "glm4_moe", "glm4_moe_lite")


def tiny_hf_model(name: str, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides) -> torch.nn.Module:
    """A tiny randomly initialised `name` model (`overrides`: config keys), glmlight's tokenizer's vocabulary."""
    from glmlight.models.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    config_cls, model_cls, kw = _configs(tok)[name]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config_cls(**{**kw, **overrides})).to(dtype)
    model.generation_config.pad_token_id = tok.pad_token_id
    return model


def build_tiny_hf(name: str, root: str, seed: int = 0, dtype: torch.dtype = torch.float32) -> str:
    """Write a tiny randomly initialised `name` checkpoint (safetensors + tokenizer) under root, its weights and
    config.json's dtype `dtype`; its path."""
    from glmlight.models.tokenizer import build_char_tokenizer

    model = tiny_hf_model(name, seed, dtype)
    path = os.path.join(root, f"tiny-{name}" + ("" if dtype == torch.float32 else f"-{str(dtype).removeprefix('torch.')}"))
    model.save_pretrained(path)
    build_char_tokenizer().save_pretrained(path)
    return path
