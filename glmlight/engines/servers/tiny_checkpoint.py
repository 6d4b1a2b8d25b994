"""Tiny Hugging Face checkpoints for running real inference servers here: a Llama (or Qwen2) of a
few hundred thousand parameters with glmlight's character tokenizer, saved as safetensors.
Used by the real-server tests, `scripts/bench.py` and `scripts/gpu_check.sh`; nothing is downloaded.

    python -m glmlight.engines.servers.tiny_checkpoint OUT_DIR [llama|qwen2] [SEED]
"""

from __future__ import annotations

import os
import shutil
import sys

import torch

ARCHES = ("llama", "qwen2")


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
    else:
        raise ValueError(f"arch must be one of {ARCHES}, got {arch!r}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(config).to(torch.float32)
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
