"""Speculative decoding in the embedded engine (rollout.speculative.depth): its samples have exactly the target's
distribution (chi-square against the distribution computed by enumeration), the recorded log-probs are the
trainer's and the replay records the trainer's forward makes, the counters and the auto-off rule, and the errors.

The exactness tests draw N seeded requests of 3 tokens from a 16-token GLM-5 at depth 2 with speculation forced
on: the first token comes from the prefill, the second and third from one speculative round (a draft accepted or
not, the residual or the bonus token). The exact distribution of the three tokens is enumerated from the model's
own forward over all 16 x 16 continuations. A test fails when a chi-square p-value is below 1e-4 (cells with an
expected count under 5 pooled); with fixed seeds the outcome is fixed, and a correct sampler would fail one of the
six tests with probability under 6e-4 over the choice of seeds.
"""

import pytest
import torch
from scipy.stats import chi2
from transformers import GlmMoeDsaForCausalLM

from glmlight.engines.base import SamplingParams
from glmlight.engines.local.engine import LocalEngine
from glmlight.errors import ConfigError
from glmlight.models.glm5.forward import forward_logits
from glmlight.models.loading import load_causal_lm
from glmlight.models.mtp import attach_mtp
from glmlight.models.tiny import tiny_config
from glmlight.ops.logprobs import logprobs_from_logits, processed_logits
from glmlight.sample import Experience, Sample
from tests.conftest import encode
from tests.support.tolerances import model_logprob_tolerance

V = 16
PROMPT = [3, 9, 4, 12, 7, 5]
P_MIN = 1e-4


def _model(vocab: int = V, head_scale: float = 3.0) -> torch.nn.Module:
    """A test-size GLM-5 with one fresh MTP layer; its head scaled so that target and draft disagree often."""
    torch.manual_seed(0)
    model = GlmMoeDsaForCausalLM(tiny_config("glm5", vocab, "test", index_topk=4)).eval()
    attach_mtp(model, 1, seed=1)
    with torch.no_grad():
        model.lm_head.weight.mul_(head_scale)
    return model


def _exact(model, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """[V, V, V]: the probability of each 3-token continuation of PROMPT under the filtered distributions, from
    the trainer's forward (glmlight's GLM-5 forward, whose DSA selection the engine's is; transformers' own
    forward selects otherwise among the few keys of these short sequences)."""
    pairs = torch.cartesian_prod(torch.arange(V), torch.arange(V))  # [V * V, 2]
    ids = torch.cat([torch.tensor(PROMPT).expand(len(pairs), -1), pairs], dim=1)
    with torch.no_grad():
        logits = forward_logits(model, ids, torch.ones_like(ids), torch.arange(ids.shape[1]).expand_as(ids),
                                start=len(PROMPT) - 1).double()
    p = processed_logits(logits, temperature, top_k, top_p).softmax(-1)  # [V * V, 3, V]
    p1, p2, p3 = p[0, 0], p[::V, 1], p[:, 2].view(V, V, V)
    return p1[:, None, None] * p2[:, :, None] * p3


def _pvalue(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, float, int]:
    """(chi-square, p-value, degrees of freedom) of counts against probs, cells expected under 5 pooled."""
    n = counts.sum()
    exp, obs = probs.flatten() * n, counts.flatten().double()
    small = exp < 5
    exp = torch.cat([exp[~small], exp[small].sum()[None]]) if small.any() else exp
    obs = torch.cat([obs[~small], obs[small].sum()[None]]) if small.any() else obs
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    dof = int(keep.sum()) - 1
    return stat, float(chi2.sf(stat, dof)), dof


def _samples(model, n: int, depth: int, temperature: float, top_k: int, top_p: float) -> tuple[torch.Tensor, dict]:
    with LocalEngine(model, max_batch_size=1024, speculative_depth=depth, speculative_auto_off=False) as engine:
        params = [SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=3, seed=s)
                  for s in range(n)]
        gens = engine.generate([PROMPT] * n, params)
        stats = engine.stats()
    assert all(len(g.token_ids) == 3 for g in gens)
    return torch.tensor([g.token_ids for g in gens]), stats


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (1.0, 6, 0.8)])
def test_speculative_samples_have_the_targets_distribution(temperature, top_k, top_p):
    model = _model()
    exact = _exact(model, temperature, top_k, top_p)
    toks, stats = _samples(model, 12000, 2, temperature, top_k, top_p)
    counts = torch.zeros(V, V, V, dtype=torch.float64)
    counts.index_put_((toks[:, 0], toks[:, 1], toks[:, 2]), torch.ones(len(toks), dtype=torch.float64),
                      accumulate=True)
    rate = stats["spec_accepted"] / stats["spec_drafted"]
    assert 0.05 < rate < 0.95, rate  # the round both accepts and rejects often: every path is exercised
    results = {"second token": _pvalue(counts.sum((0, 2)), exact.sum((0, 2))),
               "second and third": _pvalue(counts.sum(0), exact.sum(0)),
               "all three": _pvalue(counts, exact)}
    print(f"T={temperature} top_k={top_k} top_p={top_p} acceptance {rate:.3f}: " + ", ".join(
        f"{k}: chi2 {s:.1f} dof {d} p {p:.3g}" for k, (s, p, d) in results.items()))
    for what, (stat, p, dof) in results.items():
        assert p > P_MIN, (what, stat, dof, p)


def test_a_biased_sampler_fails_the_test():
    """The test's power: always accepting the draft (sampling from the draft) is caught."""
    import glmlight.ops.speculative as spec

    model = _model()
    exact = _exact(model, 1.0, 0, 1.0)
    real = spec.acceptance_probability
    spec.acceptance_probability = lambda p_x, q_x: torch.ones_like(p_x)
    try:
        toks, _ = _samples(model, 4000, 2, 1.0, 0, 1.0)
    finally:
        spec.acceptance_probability = real
    counts = torch.zeros(V, V, dtype=torch.float64)
    counts.index_put_((toks[:, 1], toks[:, 2]), torch.ones(len(toks), dtype=torch.float64), accumulate=True)
    assert _pvalue(counts, exact.sum(0))[1] < 1e-10


def _glm(tokenizer):
    model = load_causal_lm(None, tokenizer, preset="test", seed=0, index_topk=4, n_routed_experts=16,
                           num_experts_per_tok=4).eval()
    attach_mtp(model, 1, seed=2)
    return model


def test_recorded_logprobs_and_replay_records_are_the_trainers(tokenizer):
    """Trainer log-probs of speculatively sampled tokens (glmlight's GLM-5 forward, the request's temperature,
    top-k and top-p) equal the recorded ones within float32 rounding; the replay records are the choices the
    trainer's own forward makes over the whole sequence; greedy decoding gives the plain engine's tokens."""
    from tests.unit.algorithms.test_replay import _agreements, _module

    model = _glm(tokenizer)
    prompts = [encode(tokenizer, t) for t in ("1+2=", "33+44=", "5", "12345+6=")]
    params = [SamplingParams(temperature=0.9, top_k=20 * (i % 2), top_p=0.95, max_new_tokens=10 + i, seed=i)
              for i in range(len(prompts))]
    with LocalEngine(model, max_batch_size=3, speculative_depth=3, speculative_auto_off=False) as engine:
        engine.capture_replay(routing=True, index=True)
        gens = engine.generate(prompts, params)
        greedy = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=12))
        assert engine.stats()["spec_accepted"] > 0
    with LocalEngine(model, max_batch_size=3) as plain:
        assert [g.token_ids for g in plain.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=12))] \
            == [g.token_ids for g in greedy]
    seqs = [p + g.token_ids for p, g in zip(prompts, gens)]
    tol = model_logprob_tolerance(model, seqs, temperature=0.9)
    for p, g, sp in zip(prompts, gens, params):
        ids = torch.tensor([p + g.token_ids])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[:, len(p) - 1: -1]
        lp = logprobs_from_logits(logits, ids[:, len(p):], sp.temperature, sp.top_k, sp.top_p)[0]
        assert (lp - torch.tensor(g.logprobs)).abs().max() <= tol
    samples = [Sample(prompt_ids=p, response_ids=g.token_ids, loss_mask=[1] * len(g.token_ids),
                      rollout_logprobs=g.logprobs, versions=g.versions, rollout_id=i, routed_experts=g.routed_experts,
                      indexer_topk=g.indexer_topk) for i, (p, g) in enumerate(zip(prompts, gens))]
    for s in samples:
        ran = len(s.prompt_ids) + len(s.response_ids) - 1
        assert s.routed_experts.shape[0] == ran and s.indexer_topk.shape[0] == ran - 4
    exp = Experience.collate(samples, pad_token_id=tokenizer.pad_token_id)
    used: dict = {}
    with torch.no_grad():
        _module(tokenizer, model, replay="none").scoring.forward_logits(model, exp, capture=used)
    routing, index = _agreements(exp, used)
    assert routing == [1.0] and index == [1.0, 1.0]


def test_auto_off_turns_speculation_off_when_it_does_not_pay_and_probes(tokenizer, caplog):
    model = _glm(tokenizer)
    with LocalEngine(model, speculative_depth=2, speculative_probe_every=4) as engine:
        spec = engine.speculation()
        spec.draft_s, spec.verify_s, spec.plain_s = 1.0, 1.0, 1e-3  # drafting dear, plain decoding cheap
        spec.passed, spec.tests = 1.0, 10.0
        with caplog.at_level("INFO", logger="glmlight.engines.local.engine"):
            engine.generate([encode(tokenizer, "1+2=")], SamplingParams(temperature=1.0, max_new_tokens=24, seed=0))
        stats = engine.stats()
    assert not spec.on and "speculative decoding off" in caplog.text
    assert stats["spec_on_rounds"] == 1 < stats["spec_decode_rounds"]  # off after its first round
    assert stats["spec_drafted"] >= 2 * (1 + 3)  # ... then a speculative probe every 4 rounds
    assert stats["spec_decode_tokens"] + 1 == stats["tokens"] == 24


def test_speculation_needs_mtp_layers_and_the_glm_runner(tokenizer, tiny_model):
    with pytest.raises(ConfigError, match="config error: rollout.speculative.depth=2 drafts with the policy's MTP"):
        LocalEngine(tiny_model, speculative_depth=2)
    attach_mtp(tiny_model, 1, seed=0)
    with pytest.raises(ConfigError, match="needs the embedded engine's GLM-5 runner"):
        LocalEngine(tiny_model, speculative_depth=2, runner="hf")


def test_config_refuses_speculation_with_unmanaged_servers_and_compile():
    from glmlight import compose
    from glmlight.config.schema import validate

    assert validate(compose(["rollout.speculative.depth=2"])).rollout.speculative.depth == 2
    # a managed server gets the flags (tests/unit/engines/test_server_speculation.py); one of one's own does not
    with pytest.raises(ConfigError, match="config error: rollout.speculative.depth=2 with rollout=vllm adds"):
        validate(compose(["rollout=vllm", "rollout.speculative.depth=2", "rollout.server.launch=false"]))
    with pytest.raises(ConfigError, match="decodes eagerly: set rollout.compile=false"):
        validate(compose(["rollout.speculative.depth=2", "rollout.compile=true"]))
    with pytest.raises(ConfigError, match="rollout.speculative.depth must be >= 0"):
        validate(compose(["rollout.speculative.depth=-1"]))
