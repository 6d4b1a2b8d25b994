"""VLLMEngine against a loopback server speaking vLLM's OpenAI-compatible protocol and its dev-mode
endpoints (tests/protocol_servers.py), with glmlight's real worker extension behind /collective_rpc.
The in-process engine (`vllm.LLM`) needs vLLM and an accelerator and is not exercised here."""

from __future__ import annotations

import sys

import pytest
import torch

from glmlight.config import validate
from glmlight.errors import EngineError
from glmlight.rollout.http import HttpSettings
from glmlight.rollout.local import LocalEngine
from glmlight.rollout.factory import build_server_engine
from glmlight.rollout.launch import free_port
from glmlight.rollout.vllm import EXTENSION, VLLMEngine
from tests.protocol_servers import (  # noqa: F401  (model, ref: shared fixtures)
    VLLMServer, assert_same, expected, greedy, launch_config, model, prompts, ref, standin_script)


@pytest.fixture()
def server(model):
    srv = VLLMServer(LocalEngine(model)).start()
    yield srv
    srv.close()


def make(url, tmp_path, **kw) -> VLLMEngine:
    http = kw.pop("http", HttpSettings(timeout_s=5, max_retries=3, backoff_s=0.01))
    return VLLMEngine([url], http=http, ready_timeout_s=5, weight_sync_dir=str(tmp_path / "w"),
                      sync_backend="gloo", **kw)


def test_generate_equals_embedded_engine_in_order(server, ref, tokenizer, tmp_path):
    ps, sp = prompts(tokenizer, 6), greedy(tokenizer)
    with make(server.url, tmp_path) as eng:
        got = eng.generate(ps, sp)
    calls = server.calls("/v1/completions")
    rid_of = {tuple(c.body["prompt"]): c.body["request_id"] for c in calls}
    assert_same(got, expected(ref, ps, sp), served=[server.answers[rid_of[tuple(p)]] for p in ps])
    body = calls[0].body
    assert body["model"] == "tiny-glm5" and body["prompt"] == ps[0] and body["logprobs"] == 0
    assert body["return_token_ids"] is True and body["top_k"] == -1 and body["request_id"].startswith("glm-")


def test_token_ids_from_tokens_when_server_lacks_return_token_ids(server, ref, tokenizer, tmp_path):
    def older_server(body):
        del body["choices"][0]["token_ids"]
        return body

    ps, sp = prompts(tokenizer, 2), greedy(tokenizer)
    server.inject("/v1/completions", "malform", mutate=older_server, times=2)
    with make(server.url, tmp_path) as eng:
        assert_same(eng.generate(ps, sp), expected(ref, ps, sp))


def test_faults_every_prompt_answered_once_in_order(server, ref, tokenizer, tmp_path):
    ps, sp = prompts(tokenizer, 8), greedy(tokenizer)
    want = expected(ref, ps, sp)
    server.inject("/v1/completions", "status", status=503)
    server.inject("/v1/completions", "delay", seconds=3.0)
    server.inject("/v1/completions", "drop")
    server.inject("/v1/completions", "restart", seconds=0.2)
    with make(server.url, tmp_path, http=HttpSettings(timeout_s=2.0, max_retries=6, backoff_s=0.1, max_in_flight=3)) as eng:
        got = eng.generate(ps, sp)
    calls = server.calls("/v1/completions")
    rids = [c.body["request_id"] for c in calls]
    assert len(set(rids)) == len(ps)
    rid_of = {tuple(c.body["prompt"]): c.body["request_id"] for c in calls}
    assert_same(got, want, served=[server.answers[rid_of[tuple(p)]] for p in ps])
    for i, c in enumerate(calls):
        if c.fault:
            assert c.body["request_id"] in rids[i + 1:], f"request hit by {c.fault} was not retried under the same id"
    assert server.restarts == 1


def test_score_uses_prompt_logprobs(server, ref, tokenizer, tmp_path):
    ps = prompts(tokenizer, 3)
    comps = [g.token_ids for g in expected(ref, ps, greedy(tokenizer))]
    with make(server.url, tmp_path) as eng:
        got = eng.score(ps, comps)
    calls = server.calls("/v1/completions")
    rid_of = {tuple(c.body["prompt"]): c.body["request_id"] for c in calls}
    assert got == [server.scores[rid_of[tuple(p + c)]][0][len(p) - 1:] for p, c in zip(ps, comps)]  # exact
    want = ref.score(ps, comps)
    assert [x for g in got for x in g] == pytest.approx([x for w in want for x in w], abs=1e-5)
    assert calls[0].body["prompt_logprobs"] == 0


@pytest.mark.parametrize("mode", ["disk", "tensor", "distributed"])
def test_weight_sync_through_worker_extension(mode, model, server, tokenizer, tmp_path):
    ps, sp = prompts(tokenizer, 3), greedy(tokenizer)
    new = [(k, v + 0.05 * torch.randn_like(v)) for k, v in model.state_dict().items()]
    want_engine = LocalEngine(model)
    want_engine.update_weights(new, version=1)
    want = expected(want_engine, ps, sp)
    want_engine.close()
    with make(server.url, tmp_path, weight_sync=mode) as eng:
        start = len(server.calls())
        eng.update_weights(new, version=1)
        assert eng.version == 1
        sync = [(c.path, c.body.get("method") if isinstance(c.body, dict) else None) for c in server.calls()[start:]]
        got = eng.generate(ps, sp)
    load = {"disk": [("/collective_rpc", "glmlight_load_path")],
            "tensor": [("/collective_rpc", "glmlight_load_payload")],
            "distributed": [("/collective_rpc", "glmlight_init_group"), ("/collective_rpc", "glmlight_update_distributed")]}
    assert sync == [("/pause", None), *load[mode], ("/reset_prefix_cache", None), ("/resume", None),
                    ("/collective_rpc", "glmlight_weight_version")]
    assert_same(got, want)
    assert all(g.versions == [1] * len(g.token_ids) for g in got)
    assert server.worker.glmlight_weight_version()["weight_version"] == "1"


@pytest.mark.parametrize("dev_mode,extension,hint", [(False, True, "VLLM_SERVER_DEV_MODE=1"),
                                                    (True, False, "--worker-extension-cls")])
def test_update_without_dev_endpoints_says_what_to_add(model, tokenizer, tmp_path, dev_mode, extension, hint):
    srv = VLLMServer(LocalEngine(model), dev_mode=dev_mode, extension=extension).start()
    try:
        eng = make(srv.url, tmp_path)
        assert len(eng.generate(prompts(tokenizer, 1), greedy(tokenizer))) == 1  # generation still works
        with pytest.raises(EngineError) as err:
            eng.update_weights(list(model.state_dict().items()), version=1)
        eng.close()
    finally:
        srv.close()
    msg = str(err.value)
    assert "\n" not in msg and srv.url in msg and hint in msg and EXTENSION in msg


def test_api_key_bearer_and_refusal(model, tokenizer, tmp_path, monkeypatch):
    srv = VLLMServer(LocalEngine(model), api_key="k-123").start()
    monkeypatch.setenv("TEST_VLLM_KEY", "k-123")
    settings = HttpSettings(api_key_env="TEST_VLLM_KEY", timeout_s=5, backoff_s=0.01)
    try:
        eng = make(srv.url, tmp_path, http=settings)
        eng.generate(prompts(tokenizer, 1), greedy(tokenizer))
        eng.close()
        assert all(c.headers.get("Authorization") == "Bearer k-123" for c in srv.calls())
        monkeypatch.setenv("TEST_VLLM_KEY", "bad")
        with pytest.raises(EngineError) as err:
            make(srv.url, tmp_path, http=settings)
        monkeypatch.delenv("TEST_VLLM_KEY")
        with pytest.raises(EngineError, match=r"\$TEST_VLLM_KEY, but that environment variable is not set"):
            make(srv.url, tmp_path, http=settings)
    finally:
        srv.close()
    msg = str(err.value)
    assert "\n" not in msg and srv.url in msg and "refused the API key" in msg and "bad" not in msg


def test_malformed_body_and_missing_server_are_one_line(server, tokenizer, tmp_path):
    def strip(body):
        del body["choices"][0]["logprobs"]["token_logprobs"]
        return body

    server.inject("/v1/completions", "malform", mutate=strip)
    with make(server.url, tmp_path) as eng:
        with pytest.raises(EngineError) as err:
            eng.generate(prompts(tokenizer, 1), greedy(tokenizer))
    assert "\n" not in str(err.value) and server.url in str(err.value)
    assert "choices.0.logprobs.token_logprobs" in str(err.value)
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(EngineError) as err:
        make(url, tmp_path, http=HttpSettings(timeout_s=1, max_retries=1, backoff_s=0.01))
    assert "\n" not in str(err.value) and url in str(err.value) and "cannot reach vLLM server" in str(err.value)


def test_build_validates_config(server, tokenizer):
    from glmlight.errors import ConfigError

    with pytest.raises(ConfigError, match="needs rollout.server.urls"):
        build_server_engine(validate({"rollout": {"backend": "vllm"}}))
    with pytest.raises(ConfigError, match="weight_sync='nccl'"):
        build_server_engine(validate({"rollout": {"backend": "vllm", "server": {"urls": [server.url],
                                                                                  "weight_sync": "nccl"}}}))
    eng = build_server_engine(validate({"rollout": {"backend": "vllm_ascend", "server": {"urls": [server.url]}}}))
    try:
        assert isinstance(eng, VLLMEngine) and eng.name == "vLLM-Ascend" and eng.sync_backend == "hccl"
    finally:
        eng.close()


def test_managed_launch_vllm_ascend_with_standin_executable(tokenizer, tmp_path):
    cmd = [sys.executable, standin_script(tmp_path, "vllm")]
    eng = build_server_engine(launch_config(tmp_path, "vllm_ascend", cmd, weight_sync="tensor"))
    try:
        spec = eng.launcher.spec
        assert EXTENSION in spec.command and spec.env["VLLM_SERVER_DEV_MODE"] == "1"
        assert spec.env.get("VLLM_WORKER_MULTIPROC_METHOD", "spawn") == "spawn"
        got = eng.generate(prompts(tokenizer, 2), greedy(tokenizer))
        assert len(got) == 2 and all(g.token_ids for g in got)
        from glmlight.models.loading import load_causal_lm

        eng.update_weights(list(load_causal_lm(None, tokenizer, preset="test", seed=1).state_dict().items()), version=1)
        assert eng.version == 1
        proc = eng.launcher.proc
    finally:
        eng.close()
    assert proc.poll() is not None
