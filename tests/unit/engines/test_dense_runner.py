"""The dense Llama-family runner of the embedded engine (glmlight/engines/local/dense_runner.py) computes the
model's own function: for tiny random Llama (grouped-query attention, with and without attention
biases), Mistral, Qwen2 (q/k/v biases) and Qwen3 (per-head q/k norms) models, the logits of prefill and
of every decode step equal the model's own forward on the same tokens, whatever else is in the batch
and however rows join and leave; the engine's log-probs equal the trainer's; weight updates reach it."""

import pytest
import torch
import transformers as T

from glmlight.errors import EngineError
from glmlight.ops.logprobs import logprobs_from_logits
from glmlight.engines.local import dense_runner
from glmlight.engines.base import SamplingParams
from glmlight.engines.local.dense_runner import DenseRunner
from glmlight.engines.local.engine import LocalEngine
from tests.support.tolerances import model_logprob_tolerance

V = 97


def _model(kind: str, seed: int = 0) -> torch.nn.Module:
    common = dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=256, pad_token_id=0, eos_token_id=1, bos_token_id=None)
    configs = {
        "llama": (T.LlamaConfig, T.LlamaForCausalLM, dict(num_key_value_heads=2, head_dim=16)),
        "llama_bias": (T.LlamaConfig, T.LlamaForCausalLM, dict(num_key_value_heads=1, attention_bias=True,
                                                               tie_word_embeddings=True)),
        "llama3_rope": (T.LlamaConfig, T.LlamaForCausalLM, dict(num_key_value_heads=4, rope_parameters={
            "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
        "mistral": (T.MistralConfig, T.MistralForCausalLM, dict(num_key_value_heads=2, sliding_window=None)),
        "qwen2": (T.Qwen2Config, T.Qwen2ForCausalLM, dict(num_key_value_heads=2)),
        "qwen3": (T.Qwen3Config, T.Qwen3ForCausalLM, dict(num_key_value_heads=2, head_dim=16)),
    }
    config_cls, model_cls, kw = configs[kind]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config_cls(**common, **kw)).float().eval()
        for name, p in model.named_parameters():  # random biases and norm scales, so that reading them matters
            if name.endswith("bias") or "norm" in name:
                p.data.normal_(1.0 if "norm" in name else 0.0, 0.1)
    return model


KINDS = ["llama", "llama_bias", "llama3_rope", "mistral", "qwen2", "qwen3"]


def _own_logits(model, seq: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([seq])).logits[0]


@pytest.mark.parametrize("pack", [True, False], ids=["oneDNN-packed", "F.linear"])
@pytest.mark.parametrize("kind", KINDS)
def test_prefill_and_decode_logits_equal_the_models_own_forward(kind, pack):
    model = _model(kind)
    assert dense_runner.supports(model)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, V, (n,), generator=g).tolist() for n in (5, 11, 3)]
    runner = DenseRunner(model, rows=2, capacity=8, pack=pack)  # both grow while it runs
    packed = [runner.head_packed] + [w for Ly in runner.layers for w in (Ly.packed or {}).values()]
    assert all(w is not None for w in packed) if pack else packed == [None]
    seqs = [list(p) for p in prompts[:2]]
    logits = runner.admit(seqs)
    for step in range(12):
        for seq, lg in zip(seqs, logits):
            torch.testing.assert_close(lg, _own_logits(model, seq)[-1], atol=2e-5, rtol=1e-5)
        if step == 4:  # a newcomer joins the running batch
            seqs.append(list(prompts[2]))
            new = runner.admit([seqs[-1]])
            torch.testing.assert_close(new[0], _own_logits(model, seqs[-1])[-1], atol=2e-5, rtol=1e-5)
        if step == 8:  # the first row leaves; the last takes its place
            runner.keep([2, 1])
            seqs = [seqs[2], seqs[1]]
        tokens = torch.randint(2, V, (len(seqs),), generator=g)
        for seq, t in zip(seqs, tokens.tolist()):
            seq.append(t)
        logits = runner.step(tokens)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_engine_logprobs_equal_the_trainers_and_do_not_depend_on_the_batch(kind):
    model = _model(kind)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(2, V, (n,), generator=g).tolist() for n in (4, 9, 6, 13, 2)]
    params = [SamplingParams(temperature=1.0, max_new_tokens=6 + 3 * i, seed=10 + i) for i in range(len(prompts))]
    with LocalEngine(model) as engine:
        assert engine.runner_kind == "dense"
        together = engine.generate(prompts, params)
        alone = [engine.generate([p], sp)[0] for p, sp in zip(prompts, params)]
    for p, a, b in zip(prompts, together, alone):
        assert a.token_ids == b.token_ids and len(a.token_ids) > 0
        tol = model_logprob_tolerance(model, [p + a.token_ids])  # float32 rounding: ~1e-5
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=tol, rtol=0)
        ids = torch.tensor([p + a.token_ids])
        with torch.no_grad():
            lp = logprobs_from_logits(model(input_ids=ids).logits[:, len(p) - 1:-1], ids[:, len(p):], 1.0)[0]
        torch.testing.assert_close(torch.tensor(a.logprobs), lp, atol=tol, rtol=0)


def test_a_weight_update_reaches_the_dense_runner():
    model, other = _model("llama", 0), _model("llama", 1)
    prompt = [5, 6, 7, 8]
    sp = SamplingParams(temperature=1.0, max_new_tokens=5, seed=3)
    with LocalEngine(model) as engine:
        engine.update_weights(list(other.state_dict().items()), version=1)
        gen = engine.generate([prompt], sp)[0]
    ids = torch.tensor([prompt + gen.token_ids])
    with torch.no_grad():
        lp = logprobs_from_logits(other(input_ids=ids).logits[:, 3:-1], ids[:, 4:], 1.0)[0]
    tol = model_logprob_tolerance(other, [prompt + gen.token_ids])
    torch.testing.assert_close(torch.tensor(gen.logprobs), lp, atol=tol, rtol=0)


def test_models_it_cannot_reproduce_go_to_the_generic_runner():
    model = _model("mistral")
    model.config.layer_types = ["sliding_attention", "full_attention"]
    assert dense_runner.unsupported_reason(model) == "sliding-window layers"
    with LocalEngine(model) as engine:
        assert engine.runner_kind == "hf"
    with pytest.raises(EngineError, match="runner='dense' cannot run this model: sliding-window layers"):
        LocalEngine(model, runner="dense")
    gelu = _model("llama")
    gelu.config.hidden_act = "gelu"
    assert not dense_runner.supports(gelu)


@pytest.mark.slow
def test_a_compiled_decode_step_equals_the_eager_one():
    model = _model("llama")
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(2, V, (n,), generator=g).tolist() for n in (3, 8, 5)]
    params = [SamplingParams(temperature=1.0, max_new_tokens=70 + 5 * i, seed=20 + i) for i in range(3)]
    with LocalEngine(model) as eager, LocalEngine(model, compile=True) as compiled:
        a, b = eager.generate(prompts, params), compiled.generate(prompts, params)
        one = compiled.generate(prompts[:1], params[:1])[0]  # one row: decoded beside a scratch row
    for x, y in zip(a, b):
        assert x.token_ids == y.token_ids
        tol = model_logprob_tolerance(model, [p + x.token_ids for p, x in zip(prompts, a)])
        torch.testing.assert_close(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=tol, rtol=0)
    assert one.token_ids == a[0].token_ids
