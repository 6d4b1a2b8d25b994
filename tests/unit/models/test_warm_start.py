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


def test_a_warm_start_whose_expert_episodes_all_fail_stops_with_their_reasons(tokenizer, tiny_model, tmp_path):
    """Expert episodes through the agent gateway that all fail (a route the gateway does not serve, a tool_choice
    naming an undeclared tool, a first request over the context): the warm start stops with one line counting the
    failures by reason (before: `ValueError: max() arg is an empty sequence` in the loss)."""
    import openai
    import pytest

    from glmlight.agents.expert import expert_examples
    from glmlight.config import RolloutConfig
    from glmlight.data.rollout import RolloutDataModule
    from glmlight.gateway.runner import GatewayOptions

    def agent(task):
        kind = task.messages[0]["content"]
        with openai.OpenAI(base_url=task.openai_base_url, api_key=task.api_key, max_retries=0) as c:
            if kind == "404":
                c.post("/completions", body={"model": "m", "prompt": "hi"}, cast_to=object)
            tools = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}]
            c.chat.completions.create(model="m", messages=task.messages, tools=tools, tool_choice=(
                {"type": "function", "function": {"name": "nope"}} if kind == "forced" else "auto"))

    source = ListSource([Prompt(messages=[{"role": "user", "content": k}], label="0")
                         for k in ("404", "forced", "7" * 80)])
    cfg = RolloutConfig(rollout_batch_size=3, n_samples_per_prompt=1, max_new_tokens=4, max_context=64)
    make = expert_examples(lambda engine: RolloutDataModule(engine, tokenizer, source, lambda s: 0.0, cfg,
                                                            gateway=GatewayOptions(agent=agent), max_turns=2),
                           tokenizer, [(lambda messages, summarize: "answer: 0", 1.0)])
    ws = WarmStartConfig(steps=1, lr=1e-2, batch_size=3, cache_dir=str(tmp_path))
    with pytest.raises(RuntimeError) as e:
        supervised_warm_start(tiny_model, tokenizer, source, ws, {"task": "failing"}, examples=make)
    line = str(e.value)
    assert "\n" not in line and "none of expert 0's 3 episodes has an action to train on" in line, line
    for reason in ("agent_crashed: 1", "bad_request: 1", "context_exceeded: 1"):
        assert reason in line, line
