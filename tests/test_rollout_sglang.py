"""SGLangEngine against a loopback server speaking SGLang's native protocol (tests/protocol_servers.py),
backed by the embedded engine: answers must equal what the embedded engine computes for the
same requests, exactly once and in order, also under injected faults."""

from __future__ import annotations

import asyncio
import os
import signal
import sys

import pytest
import torch

from glmlight.errors import EngineError
from glmlight.rollout.http import HttpSettings
from glmlight.rollout.local import LocalEngine
from glmlight.rollout.factory import build_server_engine
from glmlight.rollout.launch import free_port
from glmlight.rollout.sglang import SGLangEngine
from tests.protocol_servers import (  # noqa: F401  (model, ref: shared fixtures)
    SGLangServer, assert_same, expected, greedy, launch_config, model, prompts, ref, standin_script)


@pytest.fixture()
def server(model):
    srv = SGLangServer(LocalEngine(model)).start()
    yield srv
    srv.close()


def make(url_or_urls, tmp_path, **kw) -> SGLangEngine:
    http = kw.pop("http", HttpSettings(timeout_s=5, max_retries=3, backoff_s=0.01))
    urls = [url_or_urls] if isinstance(url_or_urls, str) else url_or_urls
    return SGLangEngine(urls, http=http, ready_timeout_s=5, weight_sync_dir=str(tmp_path / "w"),
                        sync_backend="gloo", **kw)


def test_generate_equals_embedded_engine_in_order(server, ref, tokenizer, tmp_path):
    ps, sp = prompts(tokenizer, 6), greedy(tokenizer)
    with make(server.url, tmp_path) as eng:
        got = eng.generate(ps, sp)
    calls = server.calls("/generate")
    assert len(calls) == 6 and len({c.body["rid"] for c in calls}) == 6
    rid_of = {tuple(c.body["input_ids"]): c.body["rid"] for c in calls}
    assert_same(got, expected(ref, ps, sp), served=[server.answers[rid_of[tuple(p)]] for p in ps])
    assert all(g.versions == [0] * len(g.token_ids) for g in got)
    body = calls[0].body
    assert body["return_logprob"] is True and body["sampling_params"]["top_k"] == -1
    assert body["sampling_params"]["no_stop_trim"] is True and body["sampling_params"]["skip_special_tokens"] is False
    assert "Authorization" not in calls[0].headers


def test_faults_every_prompt_answered_once_in_order(server, ref, tokenizer, tmp_path):
    """500s, a timeout, a dropped connection and a restart mid-run: nothing lost, nothing doubled."""
    ps, sp = prompts(tokenizer, 8), greedy(tokenizer)
    want = expected(ref, ps, sp)
    server.inject("/generate", "status", status=500, times=2)
    server.inject("/generate", "delay", seconds=3.0)
    server.inject("/generate", "drop")
    server.inject("/generate", "restart", seconds=0.2)
    with make(server.url, tmp_path, http=HttpSettings(timeout_s=2.0, max_retries=6, backoff_s=0.1, max_in_flight=3)) as eng:
        got = eng.generate(ps, sp)
    calls = server.calls("/generate")
    rids = [c.body["rid"] for c in calls]
    assert len(set(rids)) == len(ps)  # a retry is the same request: same rid
    rid_of = {tuple(c.body["input_ids"]): c.body["rid"] for c in calls}
    assert_same(got, want, served=[server.answers[rid_of[tuple(p)]] for p in ps])
    faulted = [(i, c) for i, c in enumerate(calls) if c.fault]
    assert sorted(c.fault for _, c in faulted) == ["delay", "drop", "restart", "status", "status"]
    for i, c in faulted:
        assert c.body["rid"] in rids[i + 1:], f"request hit by {c.fault} was not retried under the same rid"
    assert server.restarts == 1 and eng.http.num_retries >= 5


def test_timed_out_request_is_aborted_then_retried(server, ref, tokenizer, tmp_path):
    ps, sp = prompts(tokenizer, 1), greedy(tokenizer)
    server.inject("/generate", "delay", seconds=3.0)
    with make(server.url, tmp_path, http=HttpSettings(timeout_s=2.0, max_retries=2, backoff_s=0.01)) as eng:
        assert_same(eng.generate(ps, sp), expected(ref, ps, sp))
    rid = server.calls("/generate")[0].body["rid"]
    assert [c.body["rid"] for c in server.calls("/generate")] == [rid, rid]
    assert [c.body for c in server.calls("/abort_request")] == [{"rid": rid}]


def test_sync_facade_works_inside_a_running_event_loop_and_closes(server, ref, tokenizer, tmp_path):
    ps, sp = prompts(tokenizer, 2), greedy(tokenizer)
    eng = make(server.url, tmp_path)

    async def caller():  # e.g. a notebook or an async data loader calling the synchronous engine
        return eng.generate(ps, sp)

    try:
        assert_same(asyncio.run(caller()), expected(ref, ps, sp))
    finally:
        eng.close()
    assert not eng.http.loop._thread.is_alive()
    eng.close()  # idempotent
    with pytest.raises(EngineError, match="closed"):
        eng.generate(ps, sp)


def test_score_equals_embedded_engine(server, ref, tokenizer, tmp_path):
    ps = prompts(tokenizer, 3)
    comps = [g.token_ids for g in expected(ref, ps, greedy(tokenizer))] + [[]]
    ps = ps + [ps[0]]
    with make(server.url, tmp_path) as eng:
        got = eng.score(ps, comps)
    rid_of = {tuple(c.body["input_ids"]): c.body["rid"] for c in server.calls("/generate")}
    assert got[:3] == [server.scores[rid_of[tuple(p + c)]][0] for p, c in zip(ps[:3], comps)]  # exact transport
    assert got[3] == []  # an empty completion needs no request
    want = ref.score(ps, comps)
    assert [len(g) for g in got] == [len(w) for w in want]
    assert [x for g in got for x in g] == pytest.approx([x for w in want for x in w], abs=1e-5)
    body = server.calls("/generate")[0].body
    assert body["logprob_start_len"] == len(ps[0]) - 1 and body["sampling_params"]["max_new_tokens"] == 0


@pytest.mark.parametrize("mode", ["disk", "tensor", "distributed"])
def test_weight_sync_handshake_and_new_version(mode, model, server, tokenizer, tmp_path):
    ps, sp = prompts(tokenizer, 3), greedy(tokenizer)
    new = [(k, v + 0.05 * torch.randn_like(v)) for k, v in model.state_dict().items()]
    want_engine = LocalEngine(model)
    want_engine.update_weights(new, version=1)
    want = expected(want_engine, ps, sp)
    want_engine.close()
    server.version_lag_s = 0.2 if mode == "disk" else 0.0
    with make(server.url, tmp_path, weight_sync=mode) as eng:
        eng.generate(ps[:1], sp)
        start = len(server.calls())
        eng.update_weights(new, version=1)
        assert eng.version == 1
        sync = [p for p in server.paths()[start:] if p != "/model_info"]
        got = eng.generate(ps, sp)
        if mode == "distributed":  # the group is set up once; a second sync reuses it
            eng.update_weights(new, version=2)
            assert eng.version == 2 and len(server.calls("/init_weights_update_group")) == 1
    update = {"disk": ["/update_weights_from_disk"], "tensor": ["/get_server_info", "/update_weights_from_tensor"],
              "distributed": ["/get_server_info", "/init_weights_update_group", "/update_weights_from_distributed"]}[mode]
    assert sync == ["/pause_generation", *update, "/flush_cache", "/continue_generation"]
    assert server.paths()[start + len(sync)] == "/model_info"
    assert_same(got, want)
    assert all(g.versions == [1] * len(g.token_ids) for g in got)
    if mode == "disk":
        assert len(server.calls("/model_info")) >= 2  # polled until the server reported the new version
        assert os.path.isfile(tmp_path / "w" / "v1" / "model.safetensors")
        assert sorted(os.listdir(tmp_path / "w")) == ["v1"]
        assert server.calls("/update_weights_from_disk")[0].body["weight_version"] == "1"


def test_failed_update_keeps_version_and_resumes(server, model, tmp_path):
    server.inject("/update_weights_from_disk", "status", status=400)
    with make(server.url, tmp_path) as eng:
        with pytest.raises(EngineError, match="rejected /update_weights_from_disk with HTTP 400"):
            eng.update_weights(list(model.state_dict().items()), version=1)
        assert eng.version == 0
    assert server.paths()[-1] == "/continue_generation" and server.running.is_set()
    assert len(server.calls("/update_weights_from_disk")) == 1  # a 4xx is not retried


def test_api_key_sent_as_bearer(model, tokenizer, tmp_path, monkeypatch):
    srv = SGLangServer(LocalEngine(model), api_key="s3cret-key").start()
    monkeypatch.setenv("TEST_SGLANG_KEY", "s3cret-key")
    try:
        eng = make(srv.url, tmp_path, http=HttpSettings(api_key_env="TEST_SGLANG_KEY", timeout_s=5, backoff_s=0.01))
        eng.generate(prompts(tokenizer, 2), greedy(tokenizer))
        eng.update_weights(list(model.state_dict().items()), version=1)
        eng.close()
        calls = srv.calls()
        assert calls and all(c.headers.get("Authorization") == "Bearer s3cret-key" for c in calls)
        monkeypatch.setenv("TEST_SGLANG_KEY", "not-the-key")
        with pytest.raises(EngineError) as err:
            make(srv.url, tmp_path, http=HttpSettings(api_key_env="TEST_SGLANG_KEY", timeout_s=5, backoff_s=0.01))
    finally:
        srv.close()
    msg = str(err.value)
    assert "\n" not in msg and srv.url in msg and "refused the API key" in msg and "not-the-key" not in msg


def test_malformed_body_names_url_and_field(server, tokenizer, tmp_path):
    def strip(body):
        del body["meta_info"]["output_token_logprobs"]
        return body

    server.inject("/generate", "malform", mutate=strip)
    with make(server.url, tmp_path) as eng:
        with pytest.raises(EngineError) as err:
            eng.generate(prompts(tokenizer, 1), greedy(tokenizer))
    msg = str(err.value)
    assert "\n" not in msg and server.url in msg and "meta_info.output_token_logprobs" in msg


def test_server_not_there_one_line(tmp_path):
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(EngineError) as err:
        make(url, tmp_path, http=HttpSettings(timeout_s=1, max_retries=1, backoff_s=0.01))
    msg = str(err.value)
    assert "\n" not in msg and url in msg and "cannot reach SGLang server" in msg


def test_two_servers_share_the_load_and_router_needs_workers(model, ref, tokenizer, tmp_path):
    a, b = SGLangServer(LocalEngine(model)).start(), SGLangServer(LocalEngine(model)).start()
    try:
        ps, sp = prompts(tokenizer, 6), greedy(tokenizer)
        eng = make([a.url, b.url], tmp_path)
        assert_same(eng.generate(ps, sp), expected(ref, ps, sp))
        eng.update_weights(list(model.state_dict().items()), version=1)
        eng.close()
        assert a.calls("/generate") and b.calls("/generate")
        assert a.weight_version == b.weight_version == "1"
        with make([a.url], tmp_path, router=True) as routed:
            assert len(routed.generate(ps[:2], sp)) == 2
            with pytest.raises(EngineError, match="router mode"):
                routed.update_weights(list(model.state_dict().items()), version=2)
    finally:
        a.close()
        b.close()


def test_managed_launch_with_standin_executable(tokenizer, tmp_path):
    cmd = [sys.executable, standin_script(tmp_path, "sglang")]
    eng = build_server_engine(launch_config(tmp_path, "sglang", cmd))
    try:
        proc = eng.launcher.proc
        got = eng.generate(prompts(tokenizer, 2), greedy(tokenizer))
        assert len(got) == 2 and all(g.token_ids for g in got)
        os.kill(proc.pid, signal.SIGKILL)  # the server dies mid-run: the next call says so
        proc.wait(10)
        with pytest.raises(EngineError, match="exited with code -9"):
            eng.generate(prompts(tokenizer, 1), greedy(tokenizer))
    finally:
        eng.close()
    assert proc.poll() is not None
    with open(eng.launcher.spec.log_path) as f:
        assert "stand-in sglang server ready" in f.read()


def test_managed_launch_exit_is_reported_with_log_tail(tokenizer, tmp_path):
    cmd = [sys.executable, standin_script(tmp_path, "sglang", exit_code=3, message="RuntimeError: no GPU found")]
    with pytest.raises(EngineError) as err:
        build_server_engine(launch_config(tmp_path, "sglang", cmd))
    msg = str(err.value)
    assert "\n" not in msg and "exited with code 3" in msg and "no GPU found" in msg
