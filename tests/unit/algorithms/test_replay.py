"""Routing replay and DSA index replay (`algo.replay`): the engine's records, their journey with the
sample, the trainer's forwards that use them, and the agreement monitors."""

import copy
import csv
import glob
import io
import os
from collections import Counter

import pytest
import torch

import glmlight
from glmlight import compose
from glmlight.algorithms.replay import RecordsFilter, replay_for
from glmlight.config.schema import validate
from glmlight.errors import ConfigError
from glmlight.models.loading import load_causal_lm
from glmlight.ops.logprobs import logprobs_from_logits
from glmlight.ops.mismatch import set_agreement, topk_agreement
from glmlight.config.registry import algorithm
from glmlight.engines.base import SamplingParams
from glmlight.engines.local.engine import LocalEngine
from glmlight.sample import Experience, Sample, SampleError
from tests.conftest import encode, overrides_for_tests
from tests.support.tolerances import dims, gradient_tolerances, model_logit_tolerance, model_logprob_tolerance, within

PROMPTS = ["1+2=", "33+44=", "5", "12345+6=", "7*8=", "9"]


def _model(tokenizer, **kw):
    return load_causal_lm(None, tokenizer, preset="test", seed=0, index_topk=4, n_routed_experts=16,
                          num_experts_per_tok=4, **kw).eval()


def _near_ties(model: torch.nn.Module, eps: float = 1e-7, seed: int = 1) -> torch.nn.Module:
    """Deliberate near-ties, far below what fp32 reassociation moves: every router's rows are one
    shared direction plus eps noise (the experts' scores differ in their last bits), and every DSA
    indexer's keys are one constant vector plus eps-scaled noise (the scores of all keys of a query
    differ in their last bits; the query's rotary half is zero, so the position does not separate them)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None:
                E, h = gate.weight.shape
                gate.weight.copy_(torch.randn(h, generator=g)[None] / h**0.5 + eps * torch.randn(E, h, generator=g))
                gate.e_score_correction_bias.zero_()
            ix = layer.self_attn.indexer
            if ix is not None:
                D, r = ix.head_dim, ix.qk_rope_head_dim
                ix.k_norm.weight.copy_(eps * torch.randn(D, generator=g))
                ix.k_norm.bias.copy_(torch.randn(D, generator=g))
                ix.wq_b.weight.view(ix.n_heads, D, -1)[:, :r] = 0
    return model


def _rollout(model, tokenizer, runner="auto", max_batch_size=256, **capture):
    prompts = [encode(tokenizer, t) for t in PROMPTS]
    params = [SamplingParams(temperature=1.0, max_new_tokens=6 + i, seed=i) for i in range(len(prompts))]
    with LocalEngine(model, runner=runner, max_batch_size=max_batch_size) as engine:
        engine.capture_replay(**(capture or {"routing": True, "index": True}))
        gens = engine.generate(prompts, params)
    return [Sample(prompt_ids=p, response_ids=g.token_ids, loss_mask=[1] * len(g.token_ids), rollout_logprobs=g.logprobs,
                   versions=g.versions, rollout_id=i, routed_experts=g.routed_experts, indexer_topk=g.indexer_topk)
            for i, (p, g) in enumerate(zip(prompts, gens))]


def _module(tokenizer, model, replay="both", forward="glmlight", *extra):
    cfg = validate(compose(["model.preset=test", f"algo.replay={replay}", *extra]))
    return algorithm("grpo").module(cfg.algo, model, pad_token_id=tokenizer.pad_token_id,
                                    use_glm_forward=forward == "glmlight")


def _sequences(exp: Experience) -> list[list[int]]:
    return [s.prompt_ids + s.response_ids for s in exp.samples]


def _agreements(exp: Experience, used: dict) -> tuple[list[float], list[float]]:
    """Per layer: routing set agreement and DSA overlap of the engine's records and the choices used."""
    out = []
    for kind, rec, score in (("experts", exp.routed_experts, set_agreement), ("index", exp.indexer_topk, topk_agreement)):
        per = []
        for j, layer in enumerate(sorted(used[kind])):
            t, e = used[kind][layer].reshape(*rec.shape[:2], -1), rec[:, :, j].long()
            rows = (e[..., 0] >= 0) & (t[..., 0] >= 0)
            per.append(float(score(e[rows], t[rows])))
        out.append(per)
    return out[0], out[1]


# ----------------------------------------------------------------- records
def test_records_validate_round_trip_and_collate_to_columns():
    experts = torch.tensor([[[0, 3]], [[1, 2]], [[2, 3]], [[0, 1]]], dtype=torch.uint8)  # 4 positions ran
    index = torch.tensor([[[0, 1]], [[1, 3]]], dtype=torch.int16)  # k = 2: queries at positions 2 and 3
    s = Sample(prompt_ids=[5, 6, 7], response_ids=[8, 9], loss_mask=[1, 1], rollout_logprobs=[-1.0, -1.0],
               versions=[0, 0], routed_experts=experts, indexer_topk=index)
    assert s.record_positions() == (4, 4)
    buf = io.BytesIO()
    torch.save({"queued": [[s.to_dict()]]}, buf)  # a RolloutDataModule checkpoint, loaded as Lightning does
    buf.seek(0)
    back = Sample.from_dict(torch.load(buf, weights_only=True)["queued"][0][0])
    assert torch.equal(back.routed_experts, experts) and torch.equal(back.indexer_topk, index)
    for bad, match in ((dict(routed_experts=torch.zeros(5, 1, 2, dtype=torch.uint8)), "ran 4"),
                       (dict(routed_experts=torch.zeros(4, 2, dtype=torch.uint8)), "routed_experts must be"),
                       (dict(indexer_topk=torch.zeros(3, 1, 2, dtype=torch.int16)), "query positions"),
                       (dict(indexer_topk=torch.tensor([[[0, 3]]], dtype=torch.int16)), "outside"),
                       (dict(indexer_topk=torch.zeros(1, 1, 2, dtype=torch.float32)), "int16/int32")):
        with pytest.raises(SampleError, match=match):
            Sample(prompt_ids=[5, 6, 7], response_ids=[8, 9], loss_mask=[1, 1], rollout_logprobs=[-1.0, -1.0],
                   versions=[0, 0], **bad)
    short = Sample(prompt_ids=[1], response_ids=[2, 3], loss_mask=[1, 1], rollout_logprobs=[-1.0, -1.0],
                   versions=[0, 0], routed_experts=experts[:2], indexer_topk=index[:0])
    exp = Experience.collate([s, short], pad_token_id=0)  # prompts left-padded to 3: short's offset is 2
    assert exp.routed_experts.shape == (2, 5, 1, 2) and exp.routed_experts.dtype == torch.int16
    assert exp.routed_experts[1, :, 0].tolist() == [[-1, -1], [-1, -1], [0, 3], [1, 2], [-1, -1]]
    assert exp.indexer_topk[0, :, 0].tolist() == [[-1, -1], [-1, -1], [0, 1], [1, 3], [-1, -1]]
    assert (exp.indexer_topk[1] == -1).all()
    assert Experience.collate([Sample(prompt_ids=[1], response_ids=[2], loss_mask=[1], rollout_logprobs=[0.0],
                                      versions=[0])], 0).routed_experts is None  # nothing when nobody asked


def test_both_runners_record_what_the_trainer_chooses(tokenizer):
    """Continuous batching (3 rows at a time), GLM-5 runner and generic runner: the same records, and
    the trainer's own forward (glmlight's and the model's) makes the recorded choices."""
    model = _model(tokenizer)
    glm = _rollout(model, tokenizer, max_batch_size=3)
    hf = _rollout(model, tokenizer, runner="hf", max_batch_size=3)
    for a, b in zip(glm, hf):
        assert a.response_ids == b.response_ids
        assert torch.equal(a.routed_experts, b.routed_experts) and torch.equal(a.indexer_topk, b.indexer_topk)
        ran = len(a.prompt_ids) + len(a.response_ids) - 1
        assert a.routed_experts.shape == (ran, 1, 4) and a.indexer_topk.shape == (ran - 4, 2, 4)
    exp = Experience.collate(glm, pad_token_id=tokenizer.pad_token_id)
    for forward in ("glmlight", "transformers"):
        module = _module(tokenizer, model, replay="none", forward=forward)
        used: dict = {}
        with torch.no_grad():
            module.scoring.forward_logits(model, exp, capture=used)
        routing, index = _agreements(exp, used)
        assert routing == [1.0] and index == [1.0, 1.0], forward


@pytest.mark.slow
def test_compiled_decode_records_the_same(tokenizer):
    """rollout.compile=true: the records written inside the compiled decode step equal the eager ones."""
    model = _model(tokenizer)
    prompts = [encode(tokenizer, t) for t in PROMPTS[:4]]
    params = [SamplingParams(temperature=1.0, max_new_tokens=5 + i, seed=i) for i in range(4)]
    out = []
    for compile_ in (False, True):
        with LocalEngine(model, compile=compile_) as engine:
            engine.capture_replay(routing=True, index=True)
            out.append(engine.generate(prompts, params))
    for a, b in zip(*out):
        assert a.token_ids == b.token_ids
        assert torch.equal(a.routed_experts, b.routed_experts) and torch.equal(a.indexer_topk, b.indexer_topk)


@pytest.mark.parametrize("forward", ["glmlight", "transformers"])
def test_replay_makes_engine_and_trainer_logprobs_agree_on_near_ties(tokenizer, forward):
    """Same weights, both fp32: where the routers' and indexers' near-ties fall differently in the
    engine and in the trainer, the log-probs differ (replay off); with replay they agree as closely as
    fp32 reassociation allows, and the trainer uses exactly the engine's choices."""
    model = _near_ties(_model(tokenizer))
    exp = Experience.collate(_rollout(model, tokenizer), pad_token_id=tokenizer.pad_token_id)
    gaps, agree = {}, {}
    for mode in ("none", "both"):
        module = _module(tokenizer, model, replay=mode, forward=forward)
        used: dict = {}
        with torch.no_grad():
            lp = logprobs_from_logits(module.scoring.forward_logits(model, exp, capture=used), exp.response_ids, 1.0)
        gaps[mode] = float(((lp - exp.rollout_logprobs) * exp.loss_mask).abs().max())
        agree[mode] = _agreements(exp, used)
    routing, index = agree["none"]
    tol = model_logprob_tolerance(model, _sequences(exp))  # two float32 forwards of other shapes: ~1e-5
    assert min(routing) < 0.9 and min(index) < 0.99 and gaps["none"] > 1e-2 > 100 * tol  # other experts and keys
    assert agree["both"] == ([1.0], [1.0, 1.0])
    assert gaps["both"] <= tol, (gaps["both"], tol)  # fp32 reassociation only (engine runner vs trainer forward)


@pytest.mark.parametrize("forward", ["glmlight", "transformers"])
def test_replay_survives_token_budget_micro_batches(tokenizer, forward):
    """algo.micro_batch_tokens trims each micro-batch's left prompt padding; the recorded DSA key columns
    move with it. Old log-probs and the update's forward give the engine's log-probs (fp32 rounding)
    whether the rows run as row micro-batches or packed by a token budget, with several trims."""
    model = _near_ties(_model(tokenizer))
    samples = _rollout(model, tokenizer)
    exp = Experience.collate(samples, pad_token_id=tokenizer.pad_token_id)
    tol = model_logprob_tolerance(model, _sequences(exp))  # engine runner vs trainer forward: float32 rounding
    for extra in ([], ["algo.micro_batch_tokens=40"], ["algo.micro_batch_tokens=16"]):
        module = _module(tokenizer, model, "both", forward, *extra)
        old = module.scoring.compute_logprobs(model, exp)
        gap = float(((old - exp.rollout_logprobs) * exp.loss_mask).abs().max())
        assert gap <= tol, (extra, gap, tol)
        for idx in module.parallel.micro_batches(torch.arange(exp.batch_size), exp):
            mb = module.parallel.select(exp, idx)
            lp = module.scoring.logprobs(module.scoring.forward_logits(model, mb), mb.response_ids).detach()
            assert float(((lp - mb.rollout_logprobs) * mb.loss_mask).abs().max()) <= tol, (extra, idx.tolist())


@pytest.mark.parametrize("forward", ["glmlight", "transformers"])
def test_only_the_policys_own_forwards_replay(tokenizer, forward):
    """The records are the policy's choices: the frozen reference and a trainer-side OPD teacher (models
    with their own routers and indexers) score with their own choices under algo.replay=both, giving the
    log-probs they give with replay off; the policy's own old log-probs still replay."""
    from glmlight.algorithms.teachers import ModelTeacher

    policy = _near_ties(_model(tokenizer))
    other = _near_ties(_model(tokenizer), seed=2)
    exp = Experience.collate(_rollout(policy, tokenizer), pad_token_id=tokenizer.pad_token_id)
    on = _module(tokenizer, policy, "both", forward, "algo.kl_coef=0.1")
    off = _module(tokenizer, policy, "none", forward, "algo.kl_coef=0.1")
    on.scoring.reference, off.scoring.reference = [other], [other]
    ref_on, ref_off = on.scoring.reference_logprobs(exp), off.scoring.reference_logprobs(exp)
    assert float(((ref_on - ref_off) * exp.loss_mask).abs().max()) == 0.0
    on.teacher_temperature = off.teacher_temperature = 1.0
    teacher = ModelTeacher("t", other)
    assert torch.equal(teacher.logprobs(on, exp) * exp.loss_mask, teacher.logprobs(off, exp) * exp.loss_mask)
    own = on.scoring.compute_logprobs(policy, exp)
    tol = model_logprob_tolerance(policy, _sequences(exp))  # engine runner vs trainer forward: float32 rounding
    assert float(((own - exp.rollout_logprobs) * exp.loss_mask).abs().max()) <= tol


def test_replay_only_replaces_choices_and_gradients_reach_the_router(tokenizer):
    """Where the trainer would choose what the engine chose, replay changes nothing (logits and
    gradients equal up to the order of the router's k-term normalisation sum: the records list the
    experts ascending); the router's weights for the replayed experts keep their gradient."""
    model = _model(tokenizer).train()
    exp = Experience.collate(_rollout(model, tokenizer), pad_token_id=tokenizer.pad_token_id)
    grads, logits = {}, {}
    for mode in ("none", "both"):
        model.zero_grad()
        out = _module(tokenizer, model, replay=mode).scoring.forward_logits(model, exp)
        (out.float().square().mean()).backward()
        logits[mode] = out.detach()
        grads[mode] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    # the same forward but for the order of a k-term sum: within any float32 tolerance of the model
    seqs = _sequences(exp)
    torch.testing.assert_close(logits["none"], logits["both"], rtol=0, atol=model_logit_tolerance(model.eval(), seqs))
    gate = "model.layers.1.mlp.gate.weight"
    assert gate in grads["both"] and grads["both"][gate].abs().sum() > 0
    assert grads["none"].keys() == grads["both"].keys()
    # the loss sums over every position of the batch; each tensor against its own largest entry, so that a
    # router gradient changed by replay, small beside the embeddings', would not pass
    size = {**dims(model.config), "context": exp.input_ids.shape[1], "tokens": exp.input_ids.numel()}
    assert within(grads["none"], grads["both"], gradient_tolerances(grads["none"], **size)) == []


GLM4 = ["glm4_moe", "glm4_moe_lite"]  # GLM-4.5 (dense runner) and GLM-4.7-Flash (GLM-5 runner)


def _glm4(arch: str, near_ties: bool = False, eps: float = 1e-7) -> torch.nn.Module:
    """A tiny Glm4Moe / Glm4MoeLite (tests/support/hf_models.py: sigmoid routers, Glm4Moe's with two expert groups
    of which the best is used) with random correction biases; `near_ties`: every router's rows one shared direction
    plus eps noise and no bias (its experts' scores differ in their last bits, as `_near_ties` makes them)."""
    from tests.support.hf_models import tiny_hf_model

    model = tiny_hf_model(arch).eval()
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is None:
                continue
            E, h = gate.weight.shape
            if near_ties:
                gate.weight.copy_(torch.randn(h, generator=g)[None] / h**0.5 + eps * torch.randn(E, h, generator=g))
                gate.e_score_correction_bias.zero_()
            else:  # a bias that changes the choice: the weights must still come from the unbiased scores
                gate.e_score_correction_bias.copy_(0.05 * torch.randn(E, generator=g))
    return model


def _routing_agreement(exp: Experience, used: dict) -> list[float]:
    """Per MoE layer: the fraction of (token) positions whose recorded and used expert sets are equal."""
    rec, out = exp.routed_experts, []
    for j, layer in enumerate(sorted(used["experts"])):
        t, e = used["experts"][layer].reshape(*rec.shape[:2], -1), rec[:, :, j].long()
        rows = (e[..., 0] >= 0) & (t[..., 0] >= 0)
        out.append(float(set_agreement(e[rows], t[rows])))
    return out


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", *GLM4])
def test_generic_moe_routing_replay_through_hooks(tokenizer, arch):
    """Routers other than GLM-5's through the model's own forward: softmax routers (Qwen3-MoE, Mixtral: the generic
    runner) and GLM-4.x's sigmoid router with a correction bias and expert groups (Glm4Moe: the dense runner,
    Glm4MoeLite: the GLM-5 runner). The engine records what the trainer chooses, and replaying it recomputes the
    same weights (GLM-4.x: from the unbiased scores, normalised and scaled)."""
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    if arch in GLM4:
        model = _glm4(arch)
    else:
        config, cls = (Qwen3MoeConfig, Qwen3MoeForCausalLM) if arch == "qwen3_moe" else (MixtralConfig, MixtralForCausalLM)
        torch.manual_seed(0)
        model = cls(config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                           num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, head_dim=16, num_experts=8,
                           num_local_experts=8, num_experts_per_tok=2, pad_token_id=0)).eval()
    samples = _rollout(model, tokenizer, runner="auto", max_batch_size=3, routing=True)
    assert samples[0].routed_experts.shape[1:] == (2, 2) and samples[0].indexer_topk is None
    exp = Experience.collate(samples, pad_token_id=tokenizer.pad_token_id)
    logits = {}
    for mode in ("none", "routing"):
        used: dict = {}
        scoring = _module(tokenizer, model, replay=mode, forward="transformers").scoring
        out = scoring.forward_logits(model, exp, capture=used)
        logits[mode] = out.detach()
        assert _routing_agreement(exp, used) == [1.0, 1.0]
    lp = logprobs_from_logits(logits["routing"], exp.response_ids, 1.0)
    seqs = _sequences(exp)
    assert float(((lp - exp.rollout_logprobs) * exp.loss_mask).abs().max()) <= model_logprob_tolerance(model, seqs)
    torch.testing.assert_close(logits["none"], logits["routing"], rtol=0, atol=model_logit_tolerance(model, seqs))


@pytest.mark.parametrize("arch", GLM4)
def test_glm4_replay_makes_engine_and_trainer_logprobs_agree_on_near_ties(tokenizer, arch):
    """GLM-4.x, same weights, both fp32: where near-tied routers choose differently in the engine's fast runner and
    in the trainer's forward, the log-probs differ (replay off); with routing replay they agree as closely as fp32
    reassociation allows, and the trainer uses exactly the engine's experts."""
    model = _glm4(arch, near_ties=True)
    exp = Experience.collate(_rollout(model, tokenizer, routing=True), pad_token_id=tokenizer.pad_token_id)
    gaps, agree = {}, {}
    for mode in ("none", "routing"):
        used: dict = {}
        with torch.no_grad():
            scoring = _module(tokenizer, model, replay=mode, forward="transformers").scoring
            out = scoring.forward_logits(model, exp, capture=used)
        lp = logprobs_from_logits(out, exp.response_ids, 1.0)
        gaps[mode] = float(((lp - exp.rollout_logprobs) * exp.loss_mask).abs().max())
        agree[mode] = _routing_agreement(exp, used)
    tol = model_logprob_tolerance(model, _sequences(exp))  # two float32 forwards of other shapes
    assert min(agree["none"]) < 0.9 and gaps["none"] > 1e-2 > 100 * tol, (agree, gaps)  # other experts
    assert agree["routing"] == [1.0, 1.0]
    assert gaps["routing"] <= tol, (gaps["routing"], tol)


@pytest.mark.parametrize("arch", GLM4)
def test_glm4_router_gradients_under_replay_equal_a_float64_recomputation(tokenizer, arch):
    """GLM-4.x with near-tied routers, so that the engine's experts are not all the trainer's own: under routing
    replay, every gradient of the float32 trainer (the routers' above all) equals that of a float64 recomputation
    of the same loss written here, not by glmlight: each router's weights of the recorded experts from its float64
    unbiased sigmoid scores, normalised and scaled. Without replay the routers' gradients are other ones."""
    model = _glm4(arch, near_ties=True).train()
    exp = Experience.collate(_rollout(model, tokenizer, routing=True), pad_token_id=tokenizer.pad_token_id)

    def loss(m, logits):
        lp = torch.log_softmax(logits, -1).gather(-1, exp.response_ids[..., None])[..., 0]
        return -(lp * exp.loss_mask.to(lp.dtype)).sum()

    grads = {}
    for mode in ("none", "routing"):
        model.zero_grad()
        scoring = _module(tokenizer, model, replay=mode, forward="transformers").scoring
        loss(model, scoring.forward_logits(model, exp)).backward()
        grads[mode] = {n: p.grad.double() for n, p in model.named_parameters() if p.grad is not None}

    ref = copy.deepcopy(model).double()
    ref.set_experts_implementation("eager")  # (grouped matmuls take no float64)
    B, S = exp.input_ids.shape
    layers = [i for i, layer in enumerate(ref.model.layers) if hasattr(layer.mlp, "gate")]

    def hook(layer):
        forced = exp.routed_experts[:, :, layers.index(layer)].long().reshape(B * S, -1)

        def replace(gate, args, out):
            x = args[0].reshape(-1, gate.weight.shape[1])
            scores = (x @ gate.weight.T).sigmoid()  # float64: the router's own cast to float32 is bypassed
            idx = torch.where(forced[:, :1] >= 0, forced, out[2])
            w = scores.gather(1, idx)
            w = w / (w.sum(-1, keepdim=True) + 1e-20) * gate.routed_scaling_factor
            return scores.logit(), w, idx
        return replace

    handles = [ref.model.layers[i].mlp.gate.register_forward_hook(hook(i)) for i in layers]
    try:
        out = ref(input_ids=exp.input_ids, attention_mask=exp.attention_mask, position_ids=exp.position_ids,
                  use_cache=False).logits[:, exp.prompt_length - 1: -1]
        loss(ref, out).backward()
    finally:
        for h in handles:
            h.remove()
    exact = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    assert exact.keys() == grads["routing"].keys()
    size = {**dims(model.config), "context": S, "tokens": exp.input_ids.numel()}
    bounds = gradient_tolerances(exact, **size)  # float32 rounding, each tensor against its own largest entry
    assert within(grads["routing"], exact, bounds) == []
    routers = [f"model.layers.{i}.mlp.gate.weight" for i in layers]
    assert all(float(exact[r].abs().max()) > 0 for r in routers)
    assert set(within(grads["none"], exact, bounds)) & set(routers)  # the trainer's own experts: other gradients


# ----------------------------------------------------------------- missing records
def test_samples_without_records_are_dropped_and_counted():
    def sample(rid, group, rec):
        return Sample(prompt_ids=[1, 2], response_ids=[3, 4], loss_mask=[1, 1], rollout_logprobs=[-1.0, -1.0],
                      versions=[0, 0], group_id=group, rollout_id=rid,
                      routed_experts=torch.zeros(3, 1, 2, dtype=torch.uint8) if rec else None)
    flt, counts = RecordsFilter(routing=True, index=False), Counter()
    kept = flt([sample(0, 0, True), sample(1, 0, True), sample(2, 0, False), sample(3, 1, False), sample(4, 1, False)],
               counts, 0)
    assert [s.rollout_id for s in kept] == [0, 1, 0]  # group 0 padded, group 1 dropped
    assert counts == Counter({"dropped/no_replay_records": 3, "padded/no_replay_records": 1})
    observation_tail = Sample(prompt_ids=[1, 2], response_ids=[3, 4, 5], loss_mask=[1, 0, 0],
                              rollout_logprobs=[-1.0, 0.0, 0.0], versions=[0, -1, -1],
                              routed_experts=torch.zeros(2, 1, 2, dtype=torch.uint8))  # covers what token 3 needs
    assert flt([observation_tail], Counter(), 0) == [observation_tail]
    exp = Experience.collate([sample(0, 0, True), sample(1, 0, False)], 0)
    with pytest.raises(RuntimeError, match="no routed_experts records"):
        replay_for("routing", torch.nn.Linear(1, 1), exp)


def test_start_up_errors(tmp_path, tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    dense = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32,
                                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2))
    with pytest.raises(ConfigError, match="no routed MoE"):
        _module(tokenizer, dense, replay="routing", forward="transformers")
    with pytest.raises(ConfigError, match="no DSA indexer"):
        _module(tokenizer, dense, replay="index", forward="transformers")
    with pytest.raises(ConfigError, match=r"algo.replay='bogus' is not one of"):
        validate(compose(["algo.replay=bogus"]))
    run = glmlight.build(compose(overrides_for_tests(tmp_path, "algo.replay=routing")))
    run.datamodule.engine.close()
    run.datamodule.engine = _ServerWithoutRecords()
    with pytest.raises(ConfigError, match="cannot return replay records"):
        run.fit()


class _ServerWithoutRecords:
    """What a server client is to replay before it asks its server for records: an engine without
    `capture_replay` (the generation protocol of glmlight/engines/base.py only)."""

    version = 0

    def generate(self, prompts, params):
        raise AssertionError("not reached: replay stops the run at start-up")

    def close(self):
        pass


# ----------------------------------------------------------------- real runs
def _metrics(root) -> list[dict]:
    path = glob.glob(os.path.join(str(root), "csv", "*", "metrics.csv"))[0]
    return [r for r in csv.DictReader(open(path)) if r.get("rollout/reward_mean")]


def test_async_run_replays_and_monitors_read_exactly_one(tmp_path):
    """The real Trainer, embedded engine, async rollout (records through the producer's queue):
    every sample carries its records, both agreements are exactly 1, the record memory is logged."""
    run = glmlight.build(compose(overrides_for_tests(
        tmp_path, "algo.replay=both", "rollout.mode=async", "model.index_topk=4", "rollout.max_new_tokens=8",
        "~callbacks.held_out_eval", "~callbacks.sample_table",
        "+callbacks.routing_agreement._target_=glmlight.callbacks.RoutingAgreement",
        "+callbacks.routing_agreement.every_n_steps=1",
        "+callbacks.index_agreement._target_=glmlight.callbacks.IndexAgreement",
        "+callbacks.index_agreement.every_n_steps=1")))
    run.fit()
    rows = _metrics(tmp_path)
    assert len(rows) == 2
    for r in rows:
        assert float(r["routing_agreement/mean"]) == 1.0 and float(r["index_agreement/mean"]) == 1.0
        assert float(r["rollout/replay_bytes_per_token"]) > 0
        assert not r.get("rollout/dropped/no_replay_records")
    assert run.datamodule.totals["trained"] == 32


def test_agent_episodes_carry_first_run_records(tmp_path, tokenizer):
    """Multi-turn episodes: each position keeps the record of the turn that ran it first, the sample's
    records cover every action, and a GRPO run on the calculator agent replays without drops."""
    from glmlight.agents import AgentLoop
    from glmlight.agents.loop import episode_to_samples
    from glmlight.prompt import Prompt

    from tests.support.tool_env import ThreeTurnToolEnv

    class Env(ThreeTurnToolEnv):
        observation = "obs {t}"

    model = _model(tokenizer)
    with LocalEngine(model) as engine:
        engine.capture_replay(routing=True, index=True)
        loop = AgentLoop(engine, tokenizer, Env, lambda ctx: SamplingParams(temperature=0.0, max_new_tokens=5),
                         max_turns=5)
        ep = loop.run([Prompt(messages=[{"role": "user", "content": "2*3="}], label="6")])[0]
        first = engine.generate([ep.prompt_ids], SamplingParams(temperature=0.0, max_new_tokens=5))[0]
    (s,) = episode_to_samples(ep, 0, 0)
    assert ep.turns == 3 and s.loss_mask.count(0) > 0
    ran = len(s.prompt_ids) + len(s.response_ids) - 1
    assert s.routed_experts.shape[0] == ran and s.indexer_topk.shape[0] == ran - 4  # ends with an action
    assert torch.equal(s.routed_experts[: len(first.routed_experts)], first.routed_experts)  # turn 1's records
    exp = Experience.collate([s], pad_token_id=tokenizer.pad_token_id)
    used: dict = {}
    with torch.no_grad():
        _module(tokenizer, model, replay="none").scoring.forward_logits(model, exp, capture=used)
    assert _agreements(exp, used) == ([1.0], [1.0, 1.0])
    run = glmlight.build(compose(overrides_for_tests(
        tmp_path, "algo.replay=both", "task=calculator_agent", "rollout.max_new_tokens=6", "task.agent.max_turns=2",
        "model.index_topk=8", "~callbacks.held_out_eval", "~callbacks.sample_table")))
    run.fit()
    assert run.datamodule.totals["trained"] > 0 and not run.datamodule.totals["dropped/no_replay_records"]


def test_datamodule_checkpoint_keeps_queued_records(tmp_path, tokenizer):
    run = glmlight.build(compose(overrides_for_tests(tmp_path, "rollout.mode=async")))
    dm = run.datamodule
    dm._pending = [_rollout(_model(tokenizer), tokenizer)[:2]]
    buf = io.BytesIO()
    torch.save(dm.state_dict(), buf)
    buf.seek(0)
    dm2 = glmlight.build(compose(overrides_for_tests(tmp_path / "b", "rollout.mode=async"))).datamodule
    dm2.load_state_dict(torch.load(buf, weights_only=True))
    for a, b in zip(dm._pending[0], dm2._pending[0]):
        assert torch.equal(a.routed_experts, b.routed_experts) and torch.equal(a.indexer_topk, b.indexer_topk)


@pytest.mark.slow
def test_demo_model_replay_brings_old_logprobs_closer(tmp_path):
    """The consistency demonstration's model (experiment=consistency: tiny GLM-5, 16 experts, top-4,
    index_topk 4, warm-started; bf16 engine, fp32 trainer): the same 256 rollouts scored by the trainer
    with replay off and on. Replay removes the discrete part of the mismatch: the engine's and the
    trainer's choices agree exactly, and the tokens whose context held a differing choice come as
    close to the engine as the others."""
    run = glmlight.build(compose(["experiment=consistency", "logger=none", f"trainer.default_root_dir={tmp_path}"]))
    model, dm = run.module.policy.eval(), run.datamodule
    prompts = [dm.encode(p) for p in dm.draw_prompts(256)]
    with LocalEngine(model, dtype="bfloat16") as engine:
        engine.capture_replay(routing=True, index=True)
        gens = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=16, stop_token_ids=dm.stop_ids))
    dm.close()
    exp = Experience.collate([Sample(prompt_ids=p, response_ids=g.token_ids, loss_mask=[1] * len(g.token_ids),
                                     rollout_logprobs=g.logprobs, versions=g.versions, routed_experts=g.routed_experts,
                                     indexer_topk=g.indexer_topk) for p, g in zip(prompts, gens)], pad_token_id=0)
    B, S = exp.input_ids.shape
    figures, affected = {}, None
    for mode in ("none", "both"):
        used: dict = {}
        with torch.no_grad():
            logits = _with_replay(run.module, mode).scoring.forward_logits(model, exp, capture=used)
            lp = logprobs_from_logits(logits, exp.response_ids, 1.0)
        gap = (exp.rollout_logprobs - lp) * exp.loss_mask
        if affected is None:  # action tokens whose context holds a choice the trainer makes otherwise
            differs = torch.zeros(B, S, dtype=torch.bool)
            for kind, rec in (("experts", exp.routed_experts), ("index", exp.indexer_topk)):
                for j, layer in enumerate(sorted(used[kind])):
                    t, e = used[kind][layer].reshape(B, S, -1), rec[:, :, j].long()
                    differs |= (t.sort(-1).values != e.sort(-1).values).any(-1) & (t[..., 0] >= 0) & (e[..., 0] >= 0)
            affected = (differs.cumsum(1) > 0)[:, exp.prompt_length - 1 : -1].float() * exp.loss_mask
        figures[mode] = dict(kl=float(gap.sum() / exp.loss_mask.sum()),
                             mean_abs=float(gap.abs().sum() / exp.loss_mask.sum()), max_abs=float(gap.abs().max()),
                             affected=float((gap.abs() * affected).sum() / affected.sum()),
                             agreement=_agreements(exp, used))
    print(f"\naffected action tokens: {int(affected.sum())} of {int(exp.loss_mask.sum())}")
    for mode, f in figures.items():
        print(mode, {k: v for k, v in f.items()})
    off, on = figures["none"], figures["both"]
    assert min(off["agreement"][0]) < 1 and min(off["agreement"][1]) < 1 and affected.sum() > 0
    assert on["agreement"] == ([1.0, 1.0], [1.0, 1.0, 1.0])
    assert on["mean_abs"] < off["mean_abs"] and abs(on["kl"]) < abs(off["kl"]) and on["max_abs"] < off["max_abs"]
    assert on["affected"] < off["affected"] / 2


def _with_replay(module, mode: str):
    module.scoring.replay_mode = mode
    return module
