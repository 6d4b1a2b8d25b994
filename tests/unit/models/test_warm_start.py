"""The supervised warm start's cache on a model whose input and output embeddings are one tensor."""

from __future__ import annotations

import torch

from glmlight.config import WarmStartConfig
from glmlight.data.sources import ListSource, Prompt
from glmlight.models.warm_start import supervised_warm_start


def test_a_tied_embedding_model_is_warm_started_cached_and_loaded_back(tokenizer, tmp_path):
    """SmolLM2 ties lm_head to the embedding: safetensors refuses tensors that share memory, so the
    cache write failed at the end of the warm start. The cache now holds a copy of the tied tensor, and
    a fresh model loads it with the tie intact."""
    import transformers as T

    def model():
        torch.manual_seed(0)
        cfg = T.LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                            num_attention_heads=2, num_key_value_heads=2, pad_token_id=tokenizer.pad_token_id,
                            eos_token_id=tokenizer.eos_token_id, bos_token_id=None, tie_word_embeddings=True)
        return T.LlamaForCausalLM(cfg)

    source = ListSource([Prompt(messages=[{"role": "user", "content": f"{i}+1"}], label=str(i + 1)) for i in range(8)])
    cfg = WarmStartConfig(steps=2, lr=1e-2, batch_size=4, cache_dir=str(tmp_path))
    trained = model()
    path = supervised_warm_start(trained, tokenizer, source, cfg, {"task": "tied"})
    fresh = model()
    assert supervised_warm_start(fresh, tokenizer, source, cfg, {"task": "tied"}) == path  # the cache, loaded
    assert fresh.lm_head.weight is fresh.model.embed_tokens.weight
    for k, v in trained.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v), k
    assert not torch.equal(trained.model.embed_tokens.weight, model().model.embed_tokens.weight)  # it trained
