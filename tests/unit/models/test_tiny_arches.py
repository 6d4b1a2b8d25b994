"""model.arch builds each tiny GLM architecture; model.chat_template gives the tokenizer GLM-4.5's template."""

from __future__ import annotations

import pytest
import torch

from glmlight.errors import ConfigError
from glmlight.models.loading import load_causal_lm, load_tokenizer


@pytest.mark.parametrize("arch, cls", [("glm5", "GlmMoeDsaForCausalLM"), ("glm4moe", "Glm4MoeForCausalLM"),
                                       ("glm4moe_lite", "Glm4MoeLiteForCausalLM")])
def test_each_arch_builds_its_model_from_the_seed(arch, cls):
    tok = load_tokenizer(None)
    a = load_causal_lm(None, tok, preset="test", arch=arch, seed=3)
    b = load_causal_lm(None, tok, preset="test", arch=arch, seed=3)
    assert type(a).__name__ == cls
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    cfg = a.config
    assert cfg.vocab_size == len(tok) and cfg.first_k_dense_replace == 1 and cfg.n_shared_experts == 1
    if arch == "glm4moe":  # GLM-4.5's attention: heads wider than hidden / heads, half-rotary, biases, q/k norms
        assert cfg.head_dim * cfg.num_attention_heads > cfg.hidden_size
        assert cfg.rope_parameters["partial_rotary_factor"] == 0.5 and cfg.attention_bias and cfg.use_qk_norm
        assert cfg.routed_scaling_factor == 2.5 and cfg.norm_topk_prob


def test_the_glm45_template_on_the_character_tokenizer_splits_at_glm_markers():
    tok = load_tokenizer(None, chat_template="glm45")
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert ids.startswith("[gMASK]<sop><|user|>") and ids.endswith("<|assistant|>")
    for marker in ("[gMASK]", "<sop>", "<tool_call>", "<arg_key>", "</think>"):
        assert len(tok.encode(marker, add_special_tokens=False)) == 1, marker


def test_an_unknown_template_is_a_config_error():
    with pytest.raises(ConfigError, match="model.chat_template='glm9'"):
        load_tokenizer(None, chat_template="glm9")
    with pytest.raises(ConfigError, match="cannot read"):
        load_tokenizer(None, chat_template="/nonexistent/t.jinja")
