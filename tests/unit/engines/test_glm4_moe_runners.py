"""GLM-4.x MoE models on the embedded engine's fast runners: Glm4Moe (GLM-4.5 / 4.6 / 4.7: grouped-query attention
with heads wider than hidden / heads, half-rotary RoPE, q/k/v biases, per-head q/k norms, dense first layers, MoE
layers with a shared expert and a sigmoid router with a correction bias and expert groups) on the dense runner, and
Glm4MoeLite (GLM-4.7-Flash: MLA attention, the same MoE) on the GLM-5 runner. The logits of prefill and of every
decode step equal the model's own forward while rows join and leave, the engine's log-probs equal the trainer's and
do not depend on the batch, the routing records are the router's own choices, and weight updates reach the runner."""

import logging

import pytest
import torch

from glmlight.engines.base import SamplingParams
from glmlight.engines.local import dense_runner, glm_runner
from glmlight.engines.local.engine import LocalEngine
from glmlight.models.glm5.replay import Replay, moe_layers, transformers_replay
from glmlight.ops.logprobs import logprobs_from_logits
from tests.support.hf_models import tiny_hf_model
from tests.support.tolerances import dims, logit_error, model_logprob_tolerance

# the tiny checkpoints of tests/support/hf_models.py, and variants of what GLM-4.x configs switch
KINDS = {
    "glm4_moe": ("glm4_moe", {}),  # GLM-4.5's switches: q/k norms, biases; two expert groups, the best one chosen
    "glm4_moe-air": ("glm4_moe", dict(use_qk_norm=False, attention_bias=False, n_group=1, topk_group=1,
                                      first_k_dense_replace=2, num_hidden_layers=4, partial_rotary_factor=0.25,
                                      norm_topk_prob=False, num_experts_per_tok=3)),  # GLM-4.5-Air's switches
    "glm4_moe_lite": ("glm4_moe_lite", {}),
    "glm4_moe_lite-rotate_half": ("glm4_moe_lite", dict(rope_interleave=False, attention_bias=True, n_group=2,
                                                        topk_group=1)),
}
RUNNER = {"glm4_moe": "dense", "glm4_moe_lite": "glm"}


def _model(kind: str, seed: int = 0) -> torch.nn.Module:
    arch, overrides = KINDS[kind]
    model = tiny_hf_model(arch, seed, **overrides).eval()
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():  # random biases, norm scales and correction biases, so that reading them matters
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if name.endswith("e_score_correction_bias"):
                t.copy_(0.05 * torch.randn(t.shape, generator=g))
            elif name.endswith("bias") or "norm" in name:
                t.copy_((1.0 if "norm" in name else 0.0) + 0.1 * torch.randn(t.shape, generator=g))
    return model


def _runner(model, **kw):
    if type(model).__name__ == "Glm4MoeForCausalLM":
        return dense_runner.DenseRunner(model, **kw)
    return glm_runner.GlmDsaRunner(model, **kw)


def _own_logits(model, seq: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([seq])).logits[0]


@pytest.mark.parametrize("kind", list(KINDS))
def test_prefill_and_decode_logits_equal_the_models_own_forward(kind):
    model = _model(kind)
    V = model.config.vocab_size
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, V, (n,), generator=g).tolist() for n in (5, 11, 3)]
    runner = _runner(model, rows=2, capacity=8)  # both grow while it runs
    seqs = [list(p) for p in prompts[:2]]
    logits = runner.admit(seqs)

    def check(seq, lg):
        own = _own_logits(model, seq)
        tol = 2 * logit_error(**dims(model.config), context=len(seq), logit_max=float(own.abs().max()))  # float32
        torch.testing.assert_close(lg, own[-1], atol=tol, rtol=0)

    for step in range(12):
        for seq, lg in zip(seqs, logits):
            check(seq, lg)
        if step == 4:  # a newcomer joins the running batch
            seqs.append(list(prompts[2]))
            check(seqs[-1], runner.admit([seqs[-1]])[0])
        if step == 8:  # the first row leaves; the last takes its place
            runner.keep([2, 1])
            seqs = [seqs[2], seqs[1]]
        tokens = torch.randint(3, V, (len(seqs),), generator=g)
        for seq, t in zip(seqs, tokens.tolist()):
            seq.append(t)
        logits = runner.step(tokens)


@pytest.mark.parametrize("kind", ["glm4_moe", "glm4_moe_lite"])
def test_engine_logprobs_equal_the_trainers_and_do_not_depend_on_the_batch(kind):
    model = _model(kind)
    V = model.config.vocab_size
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, V, (n,), generator=g).tolist() for n in (4, 9, 6, 13, 2)]
    params = [SamplingParams(temperature=1.0, max_new_tokens=6 + 3 * i, seed=10 + i) for i in range(len(prompts))]
    with LocalEngine(model) as engine:
        assert engine.runner_kind == RUNNER[kind]
        together = engine.generate(prompts, params)
        alone = [engine.generate([p], sp)[0] for p, sp in zip(prompts, params)]
    for p, a, b in zip(prompts, together, alone):
        assert a.token_ids == b.token_ids and len(a.token_ids) > 0
        tol = model_logprob_tolerance(model, [p + a.token_ids])  # float32 rounding
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=tol, rtol=0)
        ids = torch.tensor([p + a.token_ids])
        with torch.no_grad():
            lp = logprobs_from_logits(model(input_ids=ids).logits[:, len(p) - 1:-1], ids[:, len(p):], 1.0)[0]
        torch.testing.assert_close(torch.tensor(a.logprobs), lp, atol=tol, rtol=0)


@pytest.mark.parametrize("kind", list(KINDS))
def test_routing_records_are_the_routers_own_choices(kind):
    """Rows decoded together, three at a time: each request's records (prompt and response, every MoE layer) are
    the experts the model's own router chooses for its tokens."""
    model = _model(kind)
    V = model.config.vocab_size
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, V, (n,), generator=g).tolist() for n in (4, 9, 6, 2)]
    params = [SamplingParams(temperature=1.0, max_new_tokens=5 + i, seed=i) for i in range(len(prompts))]
    with LocalEngine(model, max_batch_size=3) as engine:
        engine.capture_replay(routing=True)
        gens = engine.generate(prompts, params)
    layers = moe_layers(model)
    k = model.config.num_experts_per_tok
    assert len(layers) == model.config.num_hidden_layers - (2 if kind == "glm4_moe-air" else 1)
    for p, gen in zip(prompts, gens):
        seq = p + gen.token_ids
        assert gen.routed_experts.shape == (len(seq) - 1, len(layers), k) and gen.indexer_topk is None
        used: dict = {}
        with torch.no_grad(), transformers_replay(model, Replay(capture=used, shape=(1, len(seq) - 1))):
            model(input_ids=torch.tensor([seq[:-1]]))
        for j, layer in enumerate(layers):
            own = used["experts"][layer][0].sort(-1).values
            assert torch.equal(gen.routed_experts[:, j].long(), own), (kind, layer)


@pytest.mark.parametrize("kind", ["glm4_moe", "glm4_moe_lite"])
def test_a_weight_update_reaches_the_runner(kind):
    model, other = _model(kind, 0), _model(kind, 1)
    prompt = [5, 6, 7, 8]
    sp = SamplingParams(temperature=1.0, max_new_tokens=5, seed=3)
    with LocalEngine(model) as engine:
        engine.update_weights(list(other.state_dict().items()), version=1)  # correction biases included
        gen = engine.generate([prompt], sp)[0]
    ids = torch.tensor([prompt + gen.token_ids])
    with torch.no_grad():
        lp = logprobs_from_logits(other(input_ids=ids).logits[:, 3:-1], ids[:, 4:], 1.0)[0]
    tol = model_logprob_tolerance(other, [prompt + gen.token_ids])
    torch.testing.assert_close(torch.tensor(gen.logprobs), lp, atol=tol, rtol=0)


def test_configurations_the_runners_cannot_reproduce_go_to_the_generic_runner(caplog):
    caplog.set_level(logging.INFO, logger="glmlight")
    lite = _model("glm4_moe_lite")
    lite.config.q_lora_rank = None  # a full-rank query (GLM-4.7-Flash has a low-rank one)
    with LocalEngine(lite) as engine:
        assert engine.runner_kind == "hf"
    assert any("decodes through its own forward" in r.getMessage() and "q_lora_rank=null" in r.getMessage()
               for r in caplog.records)
    moe = _model("glm4_moe")
    moe.config.hidden_act = "gelu"
    assert "hidden_act='gelu'" in dense_runner.unsupported_reason(moe)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["glm4_moe", "glm4_moe_lite"])
def test_a_compiled_decode_step_equals_the_eager_one(kind):
    model = _model(kind)
    V = model.config.vocab_size
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, V, (n,), generator=g).tolist() for n in (3, 8, 5)]
    params = [SamplingParams(temperature=1.0, max_new_tokens=20 + 5 * i, seed=20 + i) for i in range(3)]
    with LocalEngine(model) as eager, LocalEngine(model, compile=True) as compiled:
        eager.capture_replay(routing=True)
        compiled.capture_replay(routing=True)
        a, b = eager.generate(prompts, params), compiled.generate(prompts, params)
    for p, x, y in zip(prompts, a, b):
        assert x.token_ids == y.token_ids and torch.equal(x.routed_experts, y.routed_experts)
        tol = model_logprob_tolerance(model, [p + x.token_ids])
        torch.testing.assert_close(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=tol, rtol=0)
