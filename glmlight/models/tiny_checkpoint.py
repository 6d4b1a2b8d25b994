"""Tiny Hugging Face checkpoints for running real inference servers here: a Llama (or Qwen2) of a
few hundred thousand parameters with glmlight's character tokenizer, saved as safetensors, or a tiny
GLM-4.5 (`glm4_moe`) or GLM-4.7-Flash (`glm4_moe_lite`) of glmlight's `test` preset (glmlight/models/tiny.py).
Used by the real-server tests, `scripts/bench.py` and `scripts/gpu_check.sh`; nothing is downloaded.

    python -m glmlight.models.tiny_checkpoint OUT_DIR [llama|qwen2|glm4_moe|glm4_moe_lite] [SEED]
"""

from __future__ import annotations

import os
import shutil
import sys

import torch

ARCHES = ("llama", "qwen2", "glm4_moe", "glm4_moe_lite")


def build_tiny_checkpoint(out: str, arch: str = "llama", seed: int = 0) -> str:
    """Write the checkpoint to `out` (atomically) and return `out`. Linear weights are N(0, 0.08) and
    the output head N(0, 0.2): peaked enough that sampling is not uniform noise, small enough that
    float32 kernels of different libraries agree to ~1e-6 in log-prob."""
    import transformers as T

    from glmlight.models.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    common = dict(vocab_size=len(tok), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                  bos_token_id=None, max_position_embeddings=1024, tie_word_embeddings=False,
                  hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2)
    if arch == "llama":
        config, cls = T.LlamaConfig(head_dim=32, **common), T.LlamaForCausalLM
    elif arch == "qwen2":
        config, cls = T.Qwen2Config(**common), T.Qwen2ForCausalLM
    elif arch in ("glm4_moe", "glm4_moe_lite"):
        from glmlight.models.tiny import tiny_config

        # GLM-4.7-Flash's MLA at the widths the CPU servers take: vLLM 0.32's CPU MLA decode kernel a latent of
        # kv_lora_rank 512 + qk_rope_head_dim 64 only (v1/attention/backends/mla/cpu_mla.py; GLM-4.7-Flash's own),
        # SGLang 0.5.23's torch-native attention a value head as wide as the query/key head (GLM-4.7-Flash: 256, 256)
        mla = dict(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=8, v_head_dim=72) if "lite" in arch else {}
        config = tiny_config(arch.replace("_", "", 1), len(tok), "test", pad_token_id=tok.pad_token_id,
                             eos_token_id=tok.eos_token_id, max_position_embeddings=1024, **mla)
        cls = T.AutoModelForCausalLM
    else:
        raise ValueError(f"arch must be one of {ARCHES}, got {arch!r}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = (cls.from_config(config) if cls is T.AutoModelForCausalLM else cls(config)).to(torch.float32)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.dim() == 2:
                    p.normal_(0.0, 0.2 if name.startswith("lm_head") else 0.08)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    tmp = out.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out


if __name__ == "__main__":
    args = sys.argv[1:]
    print(build_tiny_checkpoint(args[0], args[1] if len(args) > 1 else "llama", int(args[2]) if len(args) > 2 else 0))
