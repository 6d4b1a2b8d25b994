"""Tiny GGUF files written with the `gguf` package, as llama.cpp's converter writes a Llama model.

`write_tiny_llama_gguf(path)` writes a 2-layer Llama (hidden 16, 2 query heads, 1 key/value head) with a
byte-level BPE tokenizer, a ChatML chat template and float32 tensors, and returns the Hugging Face
weights it encodes, so a test can check a conversion against them exactly.

llama.cpp stores the query and key projections with the rows of every head reordered for its rotary
layout (`permute` below, as in its convert_hf_to_gguf.py): a loader that forgets to undo it gives other
weights."""

from __future__ import annotations

import numpy as np
import torch

CHAT_TEMPLATE = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
                 "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "i s"]
SIZES = dict(hidden=16, heads=2, kv_heads=1, intermediate=32, layers=2)


def byte_alphabet() -> list[str]:
    """GPT-2's byte-level alphabet: the character each byte is spelt with, in byte order."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = list(bs), 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(bs, cs))]


def vocabulary() -> list[str]:
    return SPECIAL + byte_alphabet() + [m.replace(" ", "") for m in MERGES]


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's reordering of the rows of a query/key projection with `n_head` heads."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tiny_llama_weights(seed: int = 0) -> dict[str, torch.Tensor]:
    """Hugging Face LlamaForCausalLM weights (tied embeddings) of the tiny model."""
    s = SIZES
    h, d = s["hidden"], s["hidden"] // s["heads"]
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    w = {"model.embed_tokens.weight": r(len(vocabulary()), h), "model.norm.weight": 1 + 0.1 * r(h)}
    for i in range(s["layers"]):
        p = f"model.layers.{i}."
        w.update({p + "input_layernorm.weight": 1 + 0.1 * r(h), p + "post_attention_layernorm.weight": 1 + 0.1 * r(h),
                  p + "self_attn.q_proj.weight": r(h, h), p + "self_attn.k_proj.weight": r(s["kv_heads"] * d, h),
                  p + "self_attn.v_proj.weight": r(s["kv_heads"] * d, h), p + "self_attn.o_proj.weight": r(h, h),
                  p + "mlp.gate_proj.weight": r(s["intermediate"], h), p + "mlp.up_proj.weight": r(s["intermediate"], h),
                  p + "mlp.down_proj.weight": r(h, s["intermediate"])})
    return w


def write_tiny_llama_gguf(path: str, *, seed: int = 0, chat_template: bool = True, architecture: str = "llama",
                          truncate_to: int | None = None) -> dict[str, torch.Tensor]:
    """Write the tiny Llama as a GGUF file at `path`; returns the HF weights it encodes. `architecture`
    names another one in the metadata (keys and tensors stay Llama's); `truncate_to` cuts the file."""
    import gguf

    s = SIZES
    weights = tiny_llama_weights(seed)
    w = gguf.GGUFWriter(path, architecture)
    w.add_name("tiny-llama")
    w.add_context_length(256)
    w.add_embedding_length(s["hidden"])
    w.add_block_count(s["layers"])
    w.add_feed_forward_length(s["intermediate"])
    w.add_head_count(s["heads"])
    w.add_head_count_kv(s["kv_heads"])
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(s["hidden"] // s["heads"])
    w.add_vocab_size(len(vocabulary()))
    w.add_tokenizer_model("gpt2")
    w.add_token_list(vocabulary())
    w.add_token_types([3] * len(SPECIAL) + [1] * (len(vocabulary()) - len(SPECIAL)))
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(False)
    if chat_template:
        w.add_chat_template(CHAT_TEMPLATE)
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    w.add_tensor("token_embd.weight", weights["model.embed_tokens.weight"].numpy())
    for i in range(s["layers"]):
        for hf, gg in names.items():
            t = weights[f"model.layers.{i}.{hf}.weight"].numpy()
            if gg == "attn_q":
                t = permute(t, s["heads"])
            elif gg == "attn_k":
                t = permute(t, s["kv_heads"])
            w.add_tensor(f"blk.{i}.{gg}.weight", np.ascontiguousarray(t))
    w.add_tensor("output_norm.weight", weights["model.norm.weight"].numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    if truncate_to is not None:
        with open(path, "r+b") as f:
            f.truncate(truncate_to)
    return weights
