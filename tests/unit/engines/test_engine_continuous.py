"""Continuous batching in the embedded engine: requests join and leave a running batch.

Arrivals are staged with the engine's `on_step` hook (called by the decode thread
after every decode iteration), so "request B arrives after step 3" is exact, not a
sleep-based guess, and every test is deterministic.

Why token ids can be compared exactly in fp32: a request samples token t by
inverting its CDF at the t-th uniform of its own seeded stream, so what it shares a
batch with changes its logits only through the last bits of batched matmuls. A
different token would need a uniform within ~1e-7 of a CDF boundary; with the fixed
seeds and the fixed arrival schedule below the outcome is the same on every run.
"""

import threading
import time

import pytest
import torch

from glmlight.errors import EngineError
from glmlight.models.loading import load_causal_lm
from glmlight.engines.base import SamplingParams
from glmlight.engines.local.engine import LocalEngine
from glmlight.sample import Status
from tests.conftest import encode
from tests.support.waiting import wait_event
from tests.support.tolerances import model_logit_tolerance, model_logprob_tolerance

TEXTS = ["1+2=", "13+22=?", "7", "8+8=", "99-1="]


@pytest.fixture()
def sparse_model(tokenizer):
    """The test-size GLM-5 with a DSA top-k of 8, so the indexer really selects keys here."""
    return load_causal_lm(None, tokenizer, preset="test", seed=0, index_topk=8).eval()


def _params(i: int, n: int = 16, **kw) -> SamplingParams:
    return SamplingParams(temperature=1.0, max_new_tokens=n + 3 * i, seed=100 + i, **kw)


def _filtered(i: int) -> SamplingParams:
    return _params(i, top_k=7, top_p=0.9)


def _staggered(engine: LocalEngine, prompts: list[list[int]], arrivals: dict[int, list[int]], params=_params):
    """Submit request 0 now and request i when iteration arrivals[i] has finished; wait for all."""
    futures: dict[int, object] = {}
    all_in = threading.Event()

    def on_step(iteration: int) -> None:
        for i in arrivals.get(iteration, []):
            futures[i] = engine.submit(prompts[i], params(i))
        if len(futures) == len(prompts):
            all_in.set()

    engine.on_step = on_step
    futures[0] = engine.submit(prompts[0], params(0))
    wait_event(all_in, alive=lambda: not all(f.done() for f in futures.values()), what="the arrival steps")
    return [futures[i].result() for i in range(len(prompts))]


@pytest.mark.parametrize("runner", ["glm", "hf"])
def test_staggered_arrivals_give_one_at_a_time_tokens(tokenizer, tiny_model, sparse_model, runner):
    model = sparse_model if runner == "glm" else tiny_model  # transformers' own top-k is padding-dependent
    prompts = [encode(tokenizer, t) for t in TEXTS]
    alone = LocalEngine(model, runner=runner)
    reference = [alone.generate([p], _params(i))[0] for i, p in enumerate(prompts)]
    alone.close()

    engine = LocalEngine(model, runner=runner)
    got = _staggered(engine, prompts, {3: [1, 2], 7: [3], 12: [4]})
    stats = engine.stats()
    engine.close()
    for p, ref, g in zip(prompts, reference, got):
        assert g.token_ids == ref.token_ids
        tol = model_logprob_tolerance(model, [p + ref.token_ids])  # another batch: other matmul blockings
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(ref.logprobs), atol=tol, rtol=0)
        assert g.finish_reason == ref.finish_reason
    assert stats["admitted_mid_decode"] == 4  # every later request joined a batch that was decoding
    assert stats["max_batch"] >= 3


def test_late_request_joins_the_running_batch(tokenizer, tiny_model):
    engine = LocalEngine(tiny_model)
    p = encode(tokenizer, "3+4=")
    sizes: list[int] = []
    late = {}

    def on_step(iteration: int) -> None:
        sizes.append(engine.stats()["max_batch"])
        if iteration == 2:
            late["f"] = engine.submit(p, SamplingParams(max_new_tokens=4, seed=1))

    engine.on_step = on_step
    first = engine.submit(p, SamplingParams(max_new_tokens=12, seed=0))
    assert len(first.result().token_ids) == 12
    assert len(late["f"].result().token_ids) == 4
    stats = engine.stats()
    engine.close()
    assert stats["admitted_mid_decode"] == 1 and stats["max_batch"] == 2
    assert sizes[:2] == [1, 1] and sizes[2] == 2  # one row alone, then both rows in one decode step
    assert stats["iterations"] == 12  # the late request decoded inside the first one's steps


def test_continue_mode_records_the_version_of_every_token(tokenizer, tiny_model):
    other = load_causal_lm(None, tokenizer, preset="test", seed=123).eval()
    engine = LocalEngine(tiny_model, on_weight_update="continue")
    reached, updated = threading.Event(), threading.Event()

    def on_step(iteration: int) -> None:
        if iteration == 5:
            reached.set()
            updated.wait()  # the test thread updates the weights between two steps

    engine.on_step = on_step
    fut = engine.submit(encode(tokenizer, "9+9="), SamplingParams(max_new_tokens=20, seed=3))
    wait_event(reached, alive=lambda: not fut.done(), what="decode step 5")
    engine.update_weights(list(other.state_dict().items()), version=1)  # from this thread, between two steps
    updated.set()
    gen = fut.result()
    after = engine.generate([encode(tokenizer, "1+1=")], SamplingParams(max_new_tokens=3))[0]
    engine.close()
    assert gen.finish_reason == "length" and len(gen.token_ids) == 20
    assert gen.versions == [0] * 5 + [1] * 15
    assert after.versions == [1, 1, 1]


def test_abort_mode_and_abort_all(tokenizer, tiny_model):
    other = load_causal_lm(None, tokenizer, preset="test", seed=123).eval()
    engine = LocalEngine(tiny_model, on_weight_update="abort")
    p = encode(tokenizer, "2+5=")
    engine.on_step = lambda it: it == 4 and engine.update_weights(list(other.state_dict().items()), version=7)
    gen = engine.submit(p, SamplingParams(max_new_tokens=30, seed=1)).result()
    assert gen.finish_reason == "abort" and gen.status is Status.ABORTED
    assert len(gen.token_ids) == len(gen.logprobs) == 4 and gen.versions == [0] * 4
    engine.on_step = None
    assert engine.generate([p], SamplingParams(max_new_tokens=3))[0].versions == [7, 7, 7]

    engine.close()

    engine = LocalEngine(tiny_model)
    counted = {}

    def on_step(iteration: int) -> None:  # once all three rows decode together
        if engine.stats()["admitted"] == 3 and "n" not in counted:
            counted["n"] = engine.abort_all()

    engine.on_step = on_step
    futures = [engine.submit(p, SamplingParams(max_new_tokens=50, seed=s)) for s in range(3)]
    gens = [f.result() for f in futures]
    engine.close()
    assert counted["n"] == 3
    assert all(g.finish_reason == "abort" and 0 < len(g.token_ids) < 50 for g in gens)


def test_close_stops_the_decode_thread(tokenizer, tiny_model):
    def decode_threads() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name == "glmlight-decode" and t.is_alive()]

    before = set(decode_threads())
    engine = LocalEngine(tiny_model)
    p = encode(tokenizer, "4+4=")
    engine.generate([p], SamplingParams(max_new_tokens=3))
    assert set(decode_threads()) - before  # started lazily by the first request
    blocked = threading.Event()
    engine.on_step = lambda it: blocked.set()
    pending = engine.submit(p, SamplingParams(max_new_tokens=500, seed=2))
    wait_event(blocked, alive=lambda: not pending.done(), what="a decode step")
    engine.close()
    assert not set(decode_threads()) - before
    assert pending.result().finish_reason == "abort"  # in flight at close
    with pytest.raises(EngineError, match="closed"):
        engine.submit(p, SamplingParams())


def test_generate_keeps_order_with_a_queue(tokenizer, tiny_model):
    prompts = [encode(tokenizer, t) for t in TEXTS] * 2
    params = [SamplingParams(max_new_tokens=2 + (7 * i) % 11, seed=i) for i in range(len(prompts))]
    alone = LocalEngine(tiny_model)
    reference = [alone.generate([p], sp)[0].token_ids for p, sp in zip(prompts, params)]
    alone.close()
    engine = LocalEngine(tiny_model, max_batch_size=3)  # rows finish out of order; the queue refills them
    got = engine.generate(prompts, params)
    stats = engine.stats()
    engine.close()
    assert [g.token_ids for g in got] == reference
    assert [len(g.token_ids) for g in got] == [sp.max_new_tokens for sp in params]
    assert stats["max_batch"] == 3 and stats["admitted_mid_decode"] >= 1


def test_a_failing_request_fails_alone(tokenizer, tiny_model):
    engine = LocalEngine(tiny_model)
    bad = engine.submit([10**6], SamplingParams(max_new_tokens=3))  # not a token id of this model
    with pytest.raises(Exception):
        bad.result()
    good = engine.generate([encode(tokenizer, "1+1=")], SamplingParams(max_new_tokens=3))[0]
    engine.close()
    assert len(good.token_ids) == 3  # the engine keeps serving


def test_both_runners_decode_the_model_s_own_greedy_tokens(tokenizer, tiny_model):
    prompts = [encode(tokenizer, t) for t in TEXTS]
    params = SamplingParams(temperature=0.0, max_new_tokens=12)
    outs = {}
    for runner in ("glm", "hf"):
        engine = LocalEngine(tiny_model, runner=runner)
        outs[runner] = engine.generate(prompts, params)
        engine.close()
    for p, g, h in zip(prompts, outs["glm"], outs["hf"]):
        ids = torch.tensor([p + g.token_ids])
        with torch.no_grad():
            logits = tiny_model(ids).logits[0, len(p) - 1 : -1]
        assert logits.argmax(-1).tolist() == g.token_ids == h.token_ids
        expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(g.token_ids)[:, None])[:, 0]
        tol = model_logprob_tolerance(tiny_model, [p + g.token_ids])
        torch.testing.assert_close(torch.tensor(g.logprobs), expected, atol=tol, rtol=0)


# MLA weights absorbed (the test preset) or not (large models); decode steps eager or compiled
@pytest.mark.parametrize("growth, compile", [(1.5, False), (0.0, False), (1.5, True)])
def test_glm_runner_with_sparse_attention_equals_the_model(tokenizer, monkeypatch, growth, compile):
    """Prefill, decode, row compaction and cache growth against the model's forward, with the
    DSA top-k well below the sequence length. 16 indexer heads and non-pad tokens keep exact
    ties between index scores (where any two implementations may pick differently) away."""
    from torch._dynamo.utils import counters

    from glmlight.engines.local import glm_runner

    model = load_causal_lm(None, tokenizer, preset="test", seed=0, index_topk=8, index_n_heads=16).eval()
    monkeypatch.setattr(glm_runner, "ABSORB_MAX_GROWTH", growth)
    runner = glm_runner.GlmDsaRunner(model, rows=2, capacity=16, compile=compile)  # both grow during the test
    assert runner.absorb_q == runner.absorb_o == (growth > 0)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(6, 100, (n,), generator=g).tolist() for n in (5, 12, 3)]
    graphs = counters["stats"]["unique_graphs"]
    with torch.inference_mode():
        logits = torch.cat([runner.admit(seqs[:2]), runner.admit(seqs[2:])])
        for step in range(300):  # past the initial rotary table (256 positions): it grows too
            nxt = logits[:, 6:].argmax(-1) + 6
            for s, t in zip(seqs, nxt.tolist()):
                s.append(t)
            if step == 20:  # the first row leaves; the last one moves into its place
                runner.keep([2, 1])
                seqs, nxt = [seqs[2], seqs[1]], nxt[[2, 1]]
            if step == 280:
                with torch.inference_mode(False), torch.no_grad():  # as the engine after a weight update
                    runner.refresh()
            logits = runner.step(nxt)
            if step % 50 == 13 or step == 299:
                for s, lg in zip(seqs, logits):  # the cache's sums against one forward: float32 rounding
                    tol = model_logit_tolerance(model, [s])  # a context of up to ~300: ~1e-5
                    torch.testing.assert_close(lg, model(torch.tensor([s])).logits[0, -1], atol=tol, rtol=0)
    # compiled: one graph for all of it (rows 3 -> 2, the cache and the rotary table grown, new weights)
    assert counters["stats"]["unique_graphs"] - graphs == int(compile)


@pytest.mark.parametrize("form", ["dense", "grouped", "model's own"])
def test_glm_runner_moe_forms_equal_the_model(tokenizer, tiny_model, monkeypatch, form):
    from glmlight.models.glm5 import moe as glm_moe
    from glmlight.engines.local.glm_runner import GlmDsaRunner

    if form == "model's own":  # experts too large for the dense form: no stacked copy at all
        monkeypatch.setattr(glm_moe, "DENSE_MOE_MAX_WASTED_FLOPS", 0.0)
    runner = GlmDsaRunner(tiny_model)
    monkeypatch.setattr(glm_moe, "DENSE_MOE_MAX_WASTED_FLOPS", float("inf") if form == "dense" else 0.0)
    prompts = [encode(tokenizer, t) for t in TEXTS]
    with torch.inference_mode():
        logits = runner.admit(prompts)
        for p, lg in zip(prompts, logits):
            tol = model_logit_tolerance(tiny_model, [p])
            torch.testing.assert_close(lg, tiny_model(torch.tensor([p])).logits[0, -1], atol=tol, rtol=0)


def test_a_waiting_weight_update_stops_new_decode_steps(tokenizer, tiny_model):
    # The decode loop releases and re-takes its lock at once after every step, and Python's locks
    # are not fair: a weight update could wait many steps. A caller first takes the engine's turn
    # lock (as update_weights does); from then on the decode thread starts no new step.
    engine = LocalEngine(tiny_model)
    futures = [engine.submit(encode(tokenizer, p), SamplingParams(temperature=1.0, max_new_tokens=1000, seed=i))
               for i, p in enumerate(["1+2=", "3+4=", "5+6="])]
    while engine.stats()["decode_steps"] < 5:
        time.sleep(0.001)
    with engine._turn:
        time.sleep(0.05)  # the step that was running ends
        held = engine.stats()["iterations"]
        time.sleep(0.2)
        assert engine.stats()["iterations"] == held
    engine.update_weights(list(tiny_model.state_dict().items()), version=1)
    assert engine.version == 1 and not any(f.done() for f in futures)
    while engine.stats()["iterations"] < held + 3:  # decoding goes on
        time.sleep(0.001)
    engine.close()


def test_cache_grows_only_what_is_short(tiny_model):
    from glmlight.engines.local.glm_runner import GlmDsaRunner

    runner = GlmDsaRunner(tiny_model, rows=8, capacity=128)
    runner._ensure(30, 7)  # more rows, short sequences: the capacity stays
    assert (runner.rows_cap, runner.capacity) == (30, 128)
    runner._ensure(4, 200)  # longer sequences: the rows stay
    assert (runner.rows_cap, runner.capacity) == (30, 256)


def test_compiled_decode_equals_eager_and_survives_weight_updates(tokenizer):
    """The compiled engine (sampling fused into the step) samples the eager engine's tokens, from one
    row to five and back (requests join mid-decode and finish at different lengths), and after a
    weight update, which reuses the compiled graph."""
    from torch._dynamo.utils import counters

    # the model of the sparse runner test above (inductor's cache may serve its graph)
    sparse_model = load_causal_lm(None, tokenizer, preset="test", seed=0, index_topk=8, index_n_heads=16).eval()
    prompts = [encode(tokenizer, t) for t in TEXTS]
    new_weights = [(n, p + 0.01 * torch.randn_like(p)) for n, p in sparse_model.state_dict().items()]
    runs = {}
    for compile in (False, True):
        with LocalEngine(sparse_model, compile=compile) as engine:
            first = _staggered(engine, prompts, {3: [1, 2], 7: [3], 12: [4]}, _filtered)  # top-k/top-p in the graph
            engine.on_step = None
            graphs = counters["stats"]["unique_graphs"]
            engine.update_weights(new_weights, version=1)
            second = engine.generate(prompts, [_filtered(i) for i in range(len(prompts))])
            if compile:
                assert counters["stats"]["unique_graphs"] == graphs  # same shapes: nothing compiled anew
            runs[compile] = first + second
    updated = load_causal_lm(None, tokenizer, preset="test", seed=0, index_topk=8, index_n_heads=16).eval()
    updated.load_state_dict(dict(new_weights))
    n = len(prompts)  # the first n generations ran on the first weights, the others on the updated ones
    tol = max(model_logprob_tolerance(m, [p + e.token_ids for p, e in zip(prompts, gens)])
              for m, gens in ((sparse_model, runs[False][:n]), (updated, runs[False][n:])))
    for eager, compiled in zip(runs[False], runs[True]):
        assert compiled.token_ids == eager.token_ids
        torch.testing.assert_close(torch.tensor(compiled.logprobs), torch.tensor(eager.logprobs), atol=tol, rtol=0)


def test_compile_needs_the_glm_runner_on_cpu_or_cuda(tiny_model):
    with pytest.raises(EngineError, match="compile=True needs the GLM-5 or the dense"):
        LocalEngine(tiny_model, runner="hf", compile=True)
    with pytest.raises(EngineError, match="compile=True needs a cpu or cuda engine device"):
        LocalEngine(tiny_model, device="meta", compile=True)


def test_compile_on_cpu_needs_a_cxx_compiler(tiny_model, monkeypatch):
    import shutil

    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(EngineError, match="compile=True on CPU needs a C.. compiler"):
        LocalEngine(tiny_model, compile=True)


def test_compiled_decode_with_the_model_s_own_moe(tokenizer, tiny_model, monkeypatch, caplog):
    """Experts too large for the dense form route with data-dependent shapes, a graph break inside the
    layer loop that would make the compiled step slower than eager: the runner decodes eagerly, says so,
    and computes the eager runner's logits."""
    from glmlight.models.glm5 import moe as glm_moe
    from glmlight.engines.local.glm_runner import GlmDsaRunner

    monkeypatch.setattr(glm_moe, "DENSE_MOE_MAX_WASTED_FLOPS", 0.0)
    with caplog.at_level("WARNING", logger="glmlight.engines.local.glm_runner"):
        runners = [GlmDsaRunner(tiny_model), GlmDsaRunner(tiny_model, compile=True)]
    assert all(L.experts is None for L in runners[1].layers if L.moe)
    assert runners[1].compiled is False and runners[1]._decode is None
    assert "decoding eagerly" in caplog.text
    prompts = [encode(tokenizer, t) for t in TEXTS]
    with torch.inference_mode():
        logits = [r.admit(prompts) for r in runners]
        tol = model_logit_tolerance(tiny_model, prompts, context=max(map(len, prompts)) + 3)
        for _ in range(3):
            nxt = logits[0].argmax(-1)
            logits = [r.step(nxt) for r in runners]
            torch.testing.assert_close(logits[1], logits[0], atol=tol, rtol=0)


@pytest.mark.parametrize("runner", ["glm", "dense", "hf"])
def test_copies_of_a_prompt_share_one_prefill_and_sample_as_if_alone(tokenizer, sparse_model, runner):
    """A GRPO group: n requests with one prompt and their own seeds. The fast runners prefill the prompt
    once and copy its cache rows (stats' shared_prefills); every request samples exactly what it samples
    alone, and the ragged mix of groups decodes on as before."""
    from tests.unit.engines.test_dense_runner import _model

    model = _model("llama") if runner == "dense" else sparse_model
    prompts = [[5, 9, 11, 4], [7, 3], [5, 9, 11, 4], [5, 9, 11, 4], [7, 3], [8]]
    alone = LocalEngine(model, runner=runner)
    reference = [alone.generate([p], _params(i))[0] for i, p in enumerate(prompts)]
    alone.close()
    engine = LocalEngine(model, runner=runner)
    got = engine.generate(prompts, [_params(i) for i in range(len(prompts))])
    stats = engine.stats()
    engine.close()
    for p, ref, g in zip(prompts, reference, got):
        assert g.token_ids == ref.token_ids and g.finish_reason == ref.finish_reason
        tol = model_logprob_tolerance(model, [p + ref.token_ids])
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(ref.logprobs), atol=tol, rtol=0)
    assert stats["shared_prefills"] == (0 if runner == "hf" else 3)  # 6 requests, 3 distinct prompts
    assert len({tuple(g.token_ids) for g in got[:1] + got[2:4]}) == 3  # the copies sampled apart


def test_shared_prefill_grows_the_rows_the_copies_need():
    """Copies admitted into a full cache: the rows grow for all of them, the running rows keep their place."""
    from glmlight.engines.local.dense_runner import DenseRunner
    from tests.unit.engines.test_dense_runner import _model

    model = _model("llama")
    runner = DenseRunner(model, rows=1, capacity=4)
    first = runner.admit([[3, 4, 5]])
    shared = runner.admit_shared([[6, 7], [6, 7], [6, 7]])
    separate = DenseRunner(model, rows=4, capacity=8)
    separate.admit([[3, 4, 5]])
    alone = separate.admit([[6, 7], [6, 7], [6, 7]])
    assert runner.n == 4 and runner.rows_cap >= 4 and runner.lens.tolist() == [3, 2, 2, 2]
    tol = model_logit_tolerance(model, [[3, 4, 5, 8], [6, 7, 9]])
    torch.testing.assert_close(shared, alone, atol=tol, rtol=0)
    tokens = torch.tensor([8, 9, 10, 11])
    torch.testing.assert_close(runner.step(tokens), separate.step(tokens), atol=tol, rtol=0)
    assert first.shape[0] == 1


def test_copies_of_a_prompt_carry_their_own_replay_records(tokenizer, sparse_model):
    """With replay records on, a copy's records (routed experts and DSA selection of prompt and response)
    are those of the same request run alone: the shared prefill's records are copied with its cache rows."""
    prompts = [encode(tokenizer, "13+22=?")] * 3 + [encode(tokenizer, "7")]
    params = [_params(i) for i in range(len(prompts))]

    def run(group):
        with LocalEngine(sparse_model) as engine:
            engine.capture_replay(routing=True, index=True)
            return engine.generate(*group), engine.stats()["shared_prefills"]

    shared, n_shared = run((prompts, params))
    alone = [run(([p], [sp]))[0][0] for p, sp in zip(prompts, params)]
    assert n_shared == 2
    for a, g in zip(alone, shared):
        assert g.token_ids == a.token_ids
        assert torch.equal(g.routed_experts, a.routed_experts) and torch.equal(g.indexer_topk, a.indexer_topk)
