"""The embedded engine against the model's own forward pass (no mocks)."""

import torch

from glmlight.ops.logprobs import logprobs_from_logits
from glmlight.engines.base import SamplingParams
from glmlight.engines.local.engine import LocalEngine
from tests.conftest import encode
from tests.support.tolerances import model_logprob_tolerance

PROMPTS = ["1+2=", "13+22=?", "7"]


def _forward_logprobs(model, prompt, tokens):
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(ids).logits[:, len(prompt) - 1 : -1]
    return logits, logprobs_from_logits(logits, ids[:, len(prompt):])[0]


def test_greedy_equals_argmax_of_forward(tokenizer, tiny_model):
    engine = LocalEngine(tiny_model)
    prompts = [encode(tokenizer, p) for p in PROMPTS]
    gens = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=10))
    for p, g in zip(prompts, gens):
        assert len(g.token_ids) == 10 and g.finish_reason == "length"
        logits, _ = _forward_logprobs(tiny_model, p, g.token_ids)
        assert logits[0].argmax(-1).tolist() == g.token_ids


def test_ragged_batch_equals_one_at_a_time(tokenizer, tiny_model):
    engine = LocalEngine(tiny_model)
    prompts = [encode(tokenizer, p) for p in PROMPTS]
    assert len({len(p) for p in prompts}) == 3
    params = SamplingParams(temperature=0.0, max_new_tokens=8)
    batched = engine.generate(prompts, params)
    for p, g in zip(prompts, batched):
        assert engine.generate([p], params)[0].token_ids == g.token_ids


def test_logprobs_match_trainer_fp32_and_differ_in_bf16(tokenizer, tiny_model):
    prompts = [encode(tokenizer, p) for p in PROMPTS] * 4
    params = SamplingParams(temperature=1.0, max_new_tokens=12, seed=None)
    fp32 = LocalEngine(tiny_model, seed=1).generate(prompts, params)
    for p, g in zip(prompts, fp32):
        _, lp = _forward_logprobs(tiny_model, p, g.token_ids)
        tol = model_logprob_tolerance(tiny_model, [p + g.token_ids])  # float32 rounding: ~1e-5
        torch.testing.assert_close(torch.tensor(g.logprobs), lp, atol=tol, rtol=0)
    bf16 = LocalEngine(tiny_model, dtype="bfloat16", seed=1).generate(prompts, params)
    diffs = []
    for p, g in zip(prompts, bf16):
        _, lp = _forward_logprobs(tiny_model, p, g.token_ids)
        diffs.append((torch.tensor(g.logprobs) - lp).abs().max().item())
    assert max(diffs) > 1e-3, diffs  # a bf16 weight copy gives a measurable mismatch


def test_temperature_logprobs_are_of_the_scaled_distribution(tokenizer, tiny_model):
    p = encode(tokenizer, "2+2=")
    g = LocalEngine(tiny_model).generate([p], SamplingParams(temperature=0.7, max_new_tokens=6))[0]
    ids = torch.tensor([p + g.token_ids])
    with torch.no_grad():
        logits = tiny_model(ids).logits[:, len(p) - 1 : -1]
    expected = logprobs_from_logits(logits, ids[:, len(p):], temperature=0.7)[0]
    tol = model_logprob_tolerance(tiny_model, [p + g.token_ids], temperature=0.7)
    torch.testing.assert_close(torch.tensor(g.logprobs), expected, atol=tol, rtol=0)


def test_stop_tokens_and_max_tokens(tokenizer, tiny_model):
    engine = LocalEngine(tiny_model)
    p = encode(tokenizer, "1+2=")
    greedy = engine.generate([p], SamplingParams(temperature=0.0, max_new_tokens=10))[0].token_ids
    stop = greedy[3]
    first = greedy.index(stop)
    g = engine.generate([p], SamplingParams(temperature=0.0, max_new_tokens=10, stop_token_ids=[stop]))[0]
    assert g.token_ids == greedy[: first + 1] and g.finish_reason == "stop"  # the stop token is kept
    # per-request max_new_tokens inside one batch
    gens = engine.generate([p, p], [SamplingParams(temperature=0.0, max_new_tokens=2),
                                    SamplingParams(temperature=0.0, max_new_tokens=5)])
    assert [len(g.token_ids) for g in gens] == [2, 5]
    assert gens[1].token_ids[:2] == gens[0].token_ids


def test_per_request_seeds_are_reproducible_and_batch_independent(tokenizer, tiny_model):
    engine = LocalEngine(tiny_model)
    p, q = encode(tokenizer, "3+4="), encode(tokenizer, "12")
    a = engine.generate([p, q], [SamplingParams(max_new_tokens=8, seed=5), SamplingParams(max_new_tokens=8, seed=9)])
    b = engine.generate([p], SamplingParams(max_new_tokens=8, seed=5))
    assert a[0].token_ids == b[0].token_ids
    c = engine.generate([p], SamplingParams(max_new_tokens=8, seed=6))
    assert c[0].token_ids != b[0].token_ids or c[0].logprobs != b[0].logprobs


def test_top_k_one_is_greedy_and_top_p_filters(tokenizer, tiny_model):
    engine = LocalEngine(tiny_model)
    p = encode(tokenizer, "5+1=")
    greedy = engine.generate([p], SamplingParams(temperature=0.0, max_new_tokens=6))[0]
    topk1 = engine.generate([p], SamplingParams(temperature=1.0, top_k=1, max_new_tokens=6))[0]
    assert topk1.token_ids == greedy.token_ids
    assert all(abs(lp) < 1e-6 for lp in topk1.logprobs)  # a one-token distribution
    tiny_p = engine.generate([p], SamplingParams(temperature=1.0, top_p=1e-6, max_new_tokens=6))[0]
    assert tiny_p.token_ids == greedy.token_ids


def test_update_weights_and_version(tokenizer, tiny_model):
    from glmlight.models.loading import load_causal_lm

    engine = LocalEngine(tiny_model)
    other = load_causal_lm(None, tokenizer, preset="test", seed=123).eval()
    p = encode(tokenizer, "9+9=")
    params = SamplingParams(temperature=0.0, max_new_tokens=8)
    before = engine.generate([p], params)[0].token_ids
    engine.update_weights(list(other.state_dict().items()), version=3)
    assert engine.version == 3
    after = engine.generate([p], params)[0]
    assert after.versions == [3] * len(after.token_ids)
    fresh = LocalEngine(other).generate([p], params)[0].token_ids
    assert after.token_ids == fresh and fresh != before


def test_update_weights_from_safetensors_dir(tmp_path, tokenizer, tiny_model):
    from glmlight.models.loading import load_causal_lm, save_checkpoint

    other = load_causal_lm(None, tokenizer, preset="test", seed=7).eval()
    save_checkpoint(other, tokenizer, str(tmp_path / "ckpt"))
    engine = LocalEngine(tiny_model)
    engine.update_weights(path=str(tmp_path / "ckpt"), version=1)
    p = encode(tokenizer, "1+1=")
    params = SamplingParams(temperature=0.0, max_new_tokens=6)
    assert engine.generate([p], params)[0].token_ids == LocalEngine(other).generate([p], params)[0].token_ids


def test_score_equals_forward(tokenizer, tiny_model):
    engine = LocalEngine(tiny_model)
    p = encode(tokenizer, "4+4=")
    completion = encode(tokenizer, "8")[:5]
    _, lp = _forward_logprobs(tiny_model, p, completion)
    tol = model_logprob_tolerance(tiny_model, [p + completion])
    torch.testing.assert_close(torch.tensor(engine.score([p], [completion])[0]), lp, atol=tol, rtol=0)
