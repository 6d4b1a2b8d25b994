"""The supervised warm start's cache on a model whose input and output embeddings are one tensor."""

from __future__ import annotations

import torch

from glmlight.config.schema import WarmStartConfig
from glmlight.data.sources import ListSource
from glmlight.prompt import Prompt
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
    from glmlight.config.rollout import RolloutConfig
    from glmlight.agents.options import AgentOptions
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
                                                            agent=AgentOptions(gateway=GatewayOptions(agent=agent),
                                                                                               max_turns=2)),
                           tokenizer, [(lambda messages, summarize: "answer: 0", 1.0)])
    ws = WarmStartConfig(steps=1, lr=1e-2, batch_size=3, cache_dir=str(tmp_path))
    with pytest.raises(RuntimeError) as e:
        supervised_warm_start(tiny_model, tokenizer, source, ws, {"task": "failing"}, examples=make)
    line = str(e.value)
    assert "\n" not in line and "none of expert 0's 3 episodes has an action to train on" in line, line
    for reason in ("agent_crashed: 1", "bad_request: 1", "context_exceeded: 1"):
        assert reason in line, line


def _sums(n: int, offset: int = 0) -> ListSource:
    return ListSource([Prompt(messages=[{"role": "user", "content": f"{a}+{b}="}], label=str(a + b))
                       for a, b in ((i % 10, (3 * i + offset) % 10) for i in range(offset, offset + n))])


def test_the_mtp_warm_start_lowers_the_mtp_loss_on_held_out_rows_and_leaves_the_main_model(tokenizer, tmp_path):
    """A policy with an MTP layer has it fitted on the warm start's rows (the main model frozen): its loss on
    sums it never saw falls, the main model's weights are untouched, the result is cached and loaded back."""
    from glmlight.models.loading import load_causal_lm
    from glmlight.models.mtp import attach_mtp
    from glmlight.models.warm_start import label_examples, masked_mtp_loss, mtp_warm_start

    def model():
        m = load_causal_lm(None, tokenizer, preset="test", seed=0)
        attach_mtp(m, 1, seed=0)
        return m

    held = label_examples(tokenizer)(list(_sums(16, offset=100)))
    cfg = WarmStartConfig(steps=12, lr=1e-2, batch_size=16, warmup_steps=0, cache_dir=str(tmp_path))
    policy = model()
    main = {k: v.clone() for k, v in policy.state_dict().items() if not k.startswith("mtp.")}
    with torch.no_grad():
        before, _ = masked_mtp_loss(policy, held, tokenizer.pad_token_id)
    path = mtp_warm_start(policy, tokenizer, _sums(64), cfg, {"task": "sums"})
    with torch.no_grad():
        after, accuracy = masked_mtp_loss(policy, held, tokenizer.pad_token_id)
    assert float(after) < float(before) - 0.5, (float(before), float(after))  # 4.66 -> 3.67 measured
    assert all(torch.equal(policy.state_dict()[k], v) for k, v in main.items())
    assert all(p.requires_grad for p in policy.parameters())  # the frozen main model is trainable again
    fresh = model()
    assert mtp_warm_start(fresh, tokenizer, _sums(64), cfg, {"task": "sums"}) == path  # the cache, loaded
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in policy.state_dict().items())
    assert mtp_warm_start(model(), tokenizer, _sums(64), WarmStartConfig(steps=12, mtp=False), {}) is None


def test_build_policy_fits_the_mtp_layers_after_the_warm_start(tokenizer, tmp_path):
    """model.mtp.layers=1 with a warm start: the layer built after the warm start is fitted on its rows (cached
    beside it); with model.warm_start.mtp=false it stays as initialised."""
    from glmlight.run import build as builder
    from glmlight.config.compose import compose

    def build(*extra):
        cfg = compose(["model.preset=test", "model.mtp.layers=1", "model.warm_start.steps=2",
                       "model.warm_start.batch_size=4", f"model.warm_start.cache_dir={tmp_path}", *extra])
        return builder.build_policy(cfg, tokenizer)

    fitted, plain = build(), build("model.warm_start.mtp=false")
    assert len(list(tmp_path.glob("warm_start_mtp-*.safetensors"))) == 1
    diff = {k: not torch.equal(v, plain.state_dict()[k]) for k, v in fitted.state_dict().items()}
    assert any(v for k, v in diff.items() if k.startswith("mtp.")) and not any(
        v for k, v in diff.items() if not k.startswith("mtp."))
