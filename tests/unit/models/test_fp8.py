"""Block FP8: the quantisation math, the engine holding FP8 weights, and the server checkpoint layout."""

import json

import pytest
import torch

from glmlight.errors import ConfigError
from glmlight.models.fp8 import fp8_splits, hold_fp8_
from glmlight.models.fp8_checkpoint import (
    fp8_checkpoint_tensors,
    fp8_quantization_config,
    read_quantization,
    to_server_weights,
)
from glmlight.ops.quant import (
    FP8_DTYPE,
    dequantize_fp8_block,
    fp8_error_bound,
    fp8_scale_shape,
    quantize_fp8_block,
)
from glmlight.engines.base import SamplingParams
from glmlight.engines.local.engine import LocalEngine
from tests.conftest import encode
from tests.support.tolerances import model_logprob_tolerance


# ----------------------------------------------------------------- the math
def test_scale_is_block_amax_over_448_by_hand():
    # a 2 x 3 weight in 1 x 2 blocks: blocks [1, -4], [0.5], [2, 8], [-896]
    w = torch.tensor([[1.0, -4.0, 0.5], [2.0, 8.0, -896.0]])
    q, s = quantize_fp8_block(w, (1, 2))
    assert q.dtype == FP8_DTYPE and s.dtype == torch.float32
    assert torch.allclose(s, torch.tensor([[4 / 448, 0.5 / 448], [8 / 448, 896 / 448]]))
    # 1 / (4/448) = 112, -4 -> -448; 8 -> 448, 2 -> 112; the block maxima come back exactly
    assert q.float().tolist() == [[112.0, -448.0, 448.0], [112.0, 448.0, -448.0]]
    assert torch.allclose(dequantize_fp8_block(q, s, (1, 2)), w, rtol=1e-6)


def test_rounding_to_three_mantissa_bits_by_hand():
    # one block, max 448 -> scale 1: values are rounded to e4m3 (3 mantissa bits, ties to even)
    w = torch.tensor([[448.0, 1.0625, 1.1875, 17.0, 0.0009, 0.0011]])
    q, s = quantize_fp8_block(w, (1, 8))
    assert s.item() == 1.0
    # 1.0625 is halfway between 1 and 1.125 -> 1 (even); 1.1875 halfway 1.125 / 1.25 -> 1.25; 17 -> 16;
    # the smallest subnormal is 2^-9 = 0.00195: 0.0009 is below half of it -> 0, 0.0011 above -> 2^-9
    assert q.float().tolist() == [[448.0, 1.0, 1.25, 16.0, 0.0, 2.0**-9]]


@pytest.mark.parametrize("shape", [(128, 128), (256, 384), (100, 70), (129, 257), (3, 200, 130), (1, 1)])
def test_round_trip_error_bound_and_block_edges(shape):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(*shape, generator=g) * torch.logspace(-3, 1, shape[-1])  # magnitudes vary along a row
    q, s = quantize_fp8_block(w)
    assert tuple(s.shape) == fp8_scale_shape(shape) == (*shape[:-2], -(-shape[-2] // 128), -(-shape[-1] // 128))
    assert tuple(q.shape) == shape
    err = (dequantize_fp8_block(q, s) - w).abs()
    assert (err <= fp8_error_bound(w, s) * (1 + 1e-6)).all()
    # every block's scale is its own max / 448, partial edge blocks included
    for i in range(s.shape[-2]):
        for j in range(s.shape[-1]):
            block = w[..., i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
            amax = block.abs().amax(dim=(-2, -1))
            assert torch.allclose(s[..., i, j], amax / 448.0)


def test_blocks_are_independent():
    # a huge value in one block does not touch the precision of its neighbours
    w = torch.full((256, 256), 0.01)
    w[0, 0] = 1e4
    q, s = quantize_fp8_block(w)
    deq = dequantize_fp8_block(q, s)
    assert torch.allclose(deq[128:, :], w[128:, :], rtol=2**-4, atol=0)
    assert torch.allclose(deq[:128, 128:], w[:128, 128:], rtol=2**-4)
    assert s[0, 1] == s[1, 0] == s[1, 1] == pytest.approx(0.01 / 448)


def test_tiny_blocks_get_a_finite_scale():
    """A block whose largest magnitude is positive but below 448 x the smallest normal float32 would get
    amax / 448 = 0 (or a subnormal scale): the scale is clamped at the smallest normal float32, so no
    0 / 0 ever reaches the weights, and the error bound still holds."""
    w = torch.zeros(130, 130)
    w[0, 0] = 3e-43           # block (0, 0): subnormal float32, amax / 448 underflows to 0
    w[0, 129] = -1e-39        # block (0, 1): amax / 448 would be subnormal
    w[129, 0] = 1.0           # block (1, 0): an ordinary block beside them
    q, s = quantize_fp8_block(w)
    deq = dequantize_fp8_block(q, s)
    assert torch.isfinite(q.float()).all() and torch.isfinite(deq).all()
    assert s[0, 0] == s[0, 1] == torch.finfo(torch.float32).tiny and s[1, 0] == pytest.approx(1 / 448)
    assert ((deq - w).abs() <= fp8_error_bound(w, s)).all()
    assert deq[129, 0] == 1.0


def test_block_maxima_map_to_448_and_come_back_within_one_ulp():
    """The largest element of a block maps to ±448, but comes back as 448 · fl(amax / 448), which can
    differ from amax by one float32 ulp (the scale is rounded): what holds, over 200 random blocks."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(200, 16, 16, generator=g) * torch.logspace(-6, 6, 200)[:, None, None]
    q, s = quantize_fp8_block(w, (16, 16))
    deq = dequantize_fp8_block(q, s, (16, 16))
    at = w.abs().flatten(1).argmax(1)
    top, back = w.flatten(1).gather(1, at[:, None])[:, 0], deq.flatten(1).gather(1, at[:, None])[:, 0]
    assert q.float().flatten(1).gather(1, at[:, None]).abs().eq(448).all()
    ulp = torch.nextafter(top.abs(), torch.tensor(float("inf"))) - top.abs()
    assert ((back - top).abs() <= ulp).all()


def test_zero_block_and_bad_input():
    q, s = quantize_fp8_block(torch.zeros(130, 5))
    assert s.eq(1).all() and q.float().eq(0).all()
    with pytest.raises(ValueError, match="does not fit"):
        dequantize_fp8_block(q, torch.ones(1, 1))
    with pytest.raises(ValueError, match=r"\[\.\.\., N, K\]"):
        quantize_fp8_block(torch.ones(7))


# ----------------------------------------------------------------- which tensors
def test_which_tensors_are_quantised():
    assert fp8_splits("model.layers.0.self_attn.q_a_proj.weight", (64, 64)) == 1
    assert fp8_splits("model.layers.3.self_attn.indexer.wk.weight", (16, 64)) == 1
    assert fp8_splits("model.layers.3.mlp.experts.gate_up_proj", (4, 64, 64)) == 2
    assert fp8_splits("model.layers.3.mlp.experts.down_proj", (4, 64, 32)) == 1
    for name, shape in [("model.embed_tokens.weight", (10, 64)), ("lm_head.weight", (10, 64)),
                        ("model.layers.0.input_layernorm.weight", (64,)), ("model.layers.1.mlp.gate.weight", (4, 64)),
                        ("model.layers.1.self_attn.indexer.weights_proj.weight", (2, 64)),
                        ("model.layers.1.self_attn.o_proj.bias", (64,)),
                        ("model.layers.1.mlp.shared_expert_gate.weight", (1, 64))]:
        assert fp8_splits(name, shape) == 0, name
    assert fp8_splits("model.layers.0.self_attn.q_proj.weight", (8, 8), ignored=["self_attn.q_proj"]) == 0
    assert fp8_splits("model.layers.0.self_attn.q_proj.weight", (8, 8), ignored=["model.layers.0.self_attn.q_proj"]) == 0
    assert fp8_splits("model.layers.0.self_attn.q_proj.weight", (8, 8), ignored=["q_pro"]) == 1


# ----------------------------------------------------------------- the engine
def _prompts(tokenizer):
    return [encode(tokenizer, "3+4="), encode(tokenizer, "12+7=")]


def _flat(rows):
    return [x for r in rows for x in r]


def _fp8_reference(model):
    """The model with every FP8 weight replaced by dequantize(quantize(w)) in float32."""
    import copy

    ref = copy.deepcopy(model)
    held = hold_fp8_(ref)
    with torch.no_grad():
        from torch.nn.utils import parametrize

        for w in held.values():
            value = getattr(w.module, w.attr).clone()
            parametrize.remove_parametrizations(w.module, w.attr, leave_parametrized=False)
            setattr(w.module, w.attr, torch.nn.Parameter(value, requires_grad=False))
    return ref


def _generates_as(engine, ref, prompts, params):
    """`engine` samples the reference engine's tokens with its log-probs (within float32 rounding of the
    reference's weights, model_logprob_tolerance); returns its generations."""
    got, want = engine.generate(prompts, params), ref.generate(prompts, params)
    assert [g.token_ids for g in got] == [g.token_ids for g in want]
    for p, a, b in zip(prompts, got, want):
        assert a.logprobs == pytest.approx(b.logprobs, abs=model_logprob_tolerance(ref.model, [p + b.token_ids]))
    return got


def test_engine_holds_fp8_and_runs_the_dequantised_weights(tiny_model, tokenizer):
    with LocalEngine(tiny_model, weight_format="fp8") as e8, LocalEngine(_fp8_reference(tiny_model)) as ref, \
            LocalEngine(tiny_model) as e32:
        stored = [w.stored for w in e8._fp8.values()]
        assert stored and all(t.dtype == FP8_DTYPE for t in stored)
        state = e8.model.state_dict()
        assert any(k.endswith("weight_scale_inv") for k in state)
        assert e8.model.model.embed_tokens.weight.dtype == torch.float32  # not quantised
        prompts = _prompts(tokenizer)
        g8 = _generates_as(e8, ref, prompts, SamplingParams(max_new_tokens=6, temperature=1.0, seed=3))
        # the FP8 engine really differs from the fp32 one
        comp = [g.token_ids for g in g8]
        s8, s32 = e8.score(prompts, comp), e32.score(prompts, comp)
        tol = model_logprob_tolerance(ref.model, [p + c for p, c in zip(prompts, comp)])
        assert max(abs(x - y) for a, b in zip(s8, s32) for x, y in zip(a, b)) > 10 * tol  # not float32 rounding
        assert _flat(s8) == pytest.approx(_flat(ref.score(prompts, comp)), abs=tol)


def test_engine_quantises_at_every_update(tiny_model, tokenizer):
    import copy

    new = copy.deepcopy(tiny_model)
    with torch.no_grad():
        for p in new.parameters():
            p.mul_(1.1)
    with LocalEngine(tiny_model, weight_format="fp8") as e8, LocalEngine(_fp8_reference(new)) as ref:
        e8.update_weights(list(new.state_dict().items()), version=1)
        assert e8.version == 1
        prompts, comp = _prompts(tokenizer), [[5, 6, 7], [8, 9]]
        tol = model_logprob_tolerance(ref.model, [p + c for p, c in zip(prompts, comp)])
        assert _flat(e8.score(prompts, comp)) == pytest.approx(_flat(ref.score(prompts, comp)), abs=tol)
        w = e8._fp8["model.layers.0.self_attn.q_a_proj.weight"]
        q, s = quantize_fp8_block(new.model.layers[0].self_attn.q_a_proj.weight)
        assert torch.equal(w.stored.view(torch.uint8), q.view(torch.uint8))
        assert torch.equal(w.parametrization.weight_scale_inv, s)
        with pytest.raises(Exception, match="shape"):
            e8.update_weights([("model.layers.0.self_attn.q_a_proj.weight", torch.zeros(3, 3))], version=2)


def test_fp8_engine_generic_runner_moe(tokenizer, tmp_path):
    """A transformers MoE (Qwen3-MoE) through the generic runner: experts quantised per expert."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         num_experts=4, num_experts_per_tok=2, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(cfg).eval()
    with LocalEngine(model, weight_format="fp8") as e8, LocalEngine(_fp8_reference(model)) as ref:
        assert "model.layers.0.mlp.experts.gate_up_proj" in e8._fp8
        assert e8._fp8["model.layers.0.mlp.experts.gate_up_proj"].parametrization.weight_scale_inv.shape == (4, 2, 1)
        _generates_as(e8, ref, _prompts(tokenizer), SamplingParams(max_new_tokens=5, temperature=1.0, seed=1))


def test_fp8_engine_in_bf16(tiny_model, tokenizer):
    with LocalEngine(tiny_model, weight_format="fp8", dtype="bfloat16") as e8:
        out = e8.generate(_prompts(tokenizer), SamplingParams(max_new_tokens=4, temperature=1.0, seed=0))
        assert all(len(g.token_ids) > 0 for g in out)
        assert e8.model.model.layers[0].self_attn.q_a_proj.weight.dtype == torch.bfloat16


# ----------------------------------------------------------------- the server layout
def test_checkpoint_layout_dense_and_experts(tiny_model):
    named = list(tiny_model.state_dict().items())
    out = dict(fp8_checkpoint_tensors(named))
    E = tiny_model.config.n_routed_experts
    I, H = tiny_model.config.moe_intermediate_size, tiny_model.config.hidden_size
    # a linear weight and its scale
    w = tiny_model.model.layers[0].self_attn.q_a_proj.weight
    q, s = out["model.layers.0.self_attn.q_a_proj.weight"], out["model.layers.0.self_attn.q_a_proj.weight_scale_inv"]
    assert q.dtype == FP8_DTYPE and s.dtype == torch.float32 and s.shape == fp8_scale_shape(w.shape)
    assert torch.allclose(dequantize_fp8_block(q, s), w, atol=0, rtol=2**-4)
    # experts: fused in the model, one per expert in the checkpoint
    assert "model.layers.1.mlp.experts.gate_up_proj" not in out
    gate_up = tiny_model.model.layers[1].mlp.experts.gate_up_proj
    down = tiny_model.model.layers[1].mlp.experts.down_proj
    for e in range(E):
        for part, ref in (("gate_proj", gate_up[e, :I]), ("up_proj", gate_up[e, I:]), ("down_proj", down[e])):
            base = f"model.layers.1.mlp.experts.{e}.{part}.weight"
            assert out[base].shape == ref.shape and out[base].dtype == FP8_DTYPE
            q2, s2 = quantize_fp8_block(ref)
            assert torch.equal(out[base].view(torch.uint8), q2.view(torch.uint8))
            assert torch.equal(out[base + "_scale_inv"], s2)
    assert out["model.layers.1.mlp.experts.0.gate_proj.weight"].shape == (I, H)
    # unquantised: kept as they are
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.1.mlp.gate.weight",
                 "model.layers.0.self_attn.indexer.weights_proj.weight", "model.norm.weight"):
        assert out[name].dtype == torch.float32 and name + "_scale_inv" not in out
    assert out["model.layers.0.self_attn.indexer.wk.weight"].dtype == FP8_DTYPE
    assert not any(k.endswith("_scale_inv") and not k.endswith("weight_scale_inv") for k in out)


def test_checkpoint_layout_mixtral_names():
    t = torch.randn(2, 8, 4)
    out = dict(fp8_checkpoint_tensors([("model.layers.0.mlp.experts.gate_up_proj", t),
                                       ("model.layers.0.mlp.gate.weight", torch.randn(2, 4))], model_type="mixtral"))
    assert set(out) == {"model.layers.0.block_sparse_moe.gate.weight"} | {
        f"model.layers.0.block_sparse_moe.experts.{e}.{p}.weight{s}" for e in (0, 1) for p in ("w1", "w3")
        for s in ("", "_scale_inv")}


def test_to_server_weights_reads_the_servers_checkpoint(tmp_path, tiny_model):
    named = list(tiny_model.state_dict().items())
    assert to_server_weights(named, "auto", None) is named
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "glm_moe_dsa", "quantization_config":
                                          fp8_quantization_config((128, 128), ["self_attn.o_proj"])}))
    out = dict(to_server_weights(named, "fp8", str(tmp_path)))
    assert out["model.layers.0.self_attn.q_b_proj.weight"].dtype == FP8_DTYPE
    assert out["model.layers.0.self_attn.o_proj.weight"].dtype == torch.float32  # modules_to_not_convert
    bf16 = tmp_path / "bf16"
    bf16.mkdir()
    (bf16 / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ConfigError, match="block-FP8 checkpoint"):
        to_server_weights(named, "fp8", str(bf16))
    with pytest.raises(ConfigError, match="model_path"):
        to_server_weights(named, "fp8", None)
    assert read_quantization({"quantization_config": {"quant_method": "fp8", "weight_block_size": [64, 32],
                                                      "ignored_layers": ["lm_head"]}}) == ((64, 32), ["lm_head"])


# ----------------------------------------------------------------- config
def test_weight_format_config(tmp_path):
    import glmlight
    from glmlight import compose
    from tests.conftest import overrides_for_tests

    with pytest.raises(ConfigError, match="weight_format='fp9' is not one of"):
        glmlight.build(compose(overrides_for_tests(tmp_path, "rollout.weight_format=fp9")))
    # a server client sends the FP8 checkpoint's layout: it needs that checkpoint's config (the tiny
    # default has none) and refuses to start without it rather than send bf16 weights
    with pytest.raises(ConfigError, match="weight_format=fp8 needs the server's checkpoint config"):
        glmlight.build(compose(overrides_for_tests(tmp_path, "rollout=vllm", "rollout.weight_format=fp8",
                                                   "rollout.max_new_tokens=4")))
    run = glmlight.build(compose(overrides_for_tests(tmp_path, "rollout.weight_format=fp8", "trainer.max_steps=1",
                                                     "~callbacks.held_out_eval", "~callbacks.sample_table")))
    assert run.datamodule.engine._fp8
    run.fit()
    assert run.datamodule.engine.version == 1
