"""VLLMEngine against the vLLM stand-in (tests/support/standin_vllm.py: vLLM 0.33.0 and 0.32.0 behaviour, the
real worker extension behind /collective_rpc), backed by the embedded engine. The same client against
a real vLLM server: tests/integration/servers/test_real_servers.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from glmlight.config.schema import validate
from glmlight.errors import EngineError
from glmlight.engines.factory import build_server_engine
from glmlight.engines.servers.http import HttpSettings
from glmlight.engines.servers.launch import PACKAGE_ROOT, free_port, server_processes
from glmlight.engines.local.engine import LocalEngine
from glmlight.engines.servers.vllm.engine import VLLMEngine
from glmlight.engines.servers.vllm.wire import EXTENSION
from tests.conftest import REPO
from tests.support.tolerances import model_logprob_tolerance
from tests.support.protocol_servers import (  # noqa: F401  (model, ref: shared fixtures)
    VLLMServer, answers_of, assert_same, expected, greedy, launch_config, model, perturbed, prompts, ref,
    standin_script)


@pytest.fixture()
def server(model):
    srv = VLLMServer(LocalEngine(model)).start()
    yield srv
    srv.close()


def make(url, tmp_path, **kw) -> VLLMEngine:
    http = kw.pop("http", HttpSettings(timeout_s=120, max_retries=3, backoff_s=0.01))
    urls = [url] if isinstance(url, str) else url
    return VLLMEngine(urls, http=http, ready_timeout_s=120, weight_sync_dir=str(tmp_path / "w"),
                      sync_backend="gloo", **kw)


def test_generate_equals_embedded_engine_in_order(server, ref, tokenizer, tmp_path):
    ps, sp = prompts(tokenizer, 6), greedy(tokenizer)
    with make(server.url, tmp_path) as eng:
        start = len(server.calls())
        got = eng.generate(ps, sp)
    calls = server.calls("/v1/completions")[-6:]
    rid_of = {tuple(c.body["prompt"]): c.body["request_id"] for c in calls}
    assert_same(got, expected(ref, ps, sp), served=[server.answers[rid_of[tuple(p)]] for p in ps])
    body = calls[0].body
    assert body["model"] == "tiny-glm5" and body["logprobs"] == 0 and body["return_weight_versions"] is True
    assert body["return_token_ids"] is True and body["top_k"] == -1 and body["request_id"].startswith("glm-")
    assert [c.path for c in server.calls()[start:]] == ["/v1/completions"] * 6


def test_version_032_gets_no_return_weight_versions_and_holds_requests_while_paused(model, ref, tokenizer, tmp_path):
    srv = VLLMServer(LocalEngine(model), version="0.32.0").start()
    try:
        with make(srv.url, tmp_path) as eng:
            ps, sp = prompts(tokenizer, 2), greedy(tokenizer)
            assert_same(eng.generate(ps, sp), expected(ref, ps, sp))
            assert "return_weight_versions" not in srv.calls("/v1/completions")[-1].body
            srv.paused = True
            srv.resumed.clear()
            threading.Timer(0.5, lambda: (setattr(srv, "paused", False), srv.resumed.set())).start()
            t0 = time.monotonic()
            assert_same(eng.generate(ps, sp), expected(ref, ps, sp))  # held by the server, then answered
            assert time.monotonic() - t0 >= 0.4 and eng.http.num_retries == 0
    finally:
        srv.close()


def test_requests_answered_503_while_paused_wait_without_spending_retries(server, ref, tokenizer, tmp_path):
    """vLLM 0.33 answers 503 "Generation is paused" while paused: the client waits for the resume
    (longer than its whole retry budget here) instead of failing."""
    ps, sp = prompts(tokenizer, 3), greedy(tokenizer)
    with make(server.url, tmp_path, http=HttpSettings(timeout_s=120, max_retries=1, backoff_s=0.05)) as eng:
        server.paused = True
        threading.Timer(1.0, lambda: setattr(server, "paused", False)).start()
        assert_same(eng.generate(ps, sp), expected(ref, ps, sp))
        assert eng.http.num_retries == 0
    assert sum(1 for c in server.calls("/v1/completions")) > 3  # the 503s were answered and waited out


def test_token_ids_from_tokens_when_server_lacks_return_token_ids(server, ref, tokenizer, tmp_path):
    def older_server(body):
        del body["choices"][0]["token_ids"]
        return body

    ps, sp = prompts(tokenizer, 2), greedy(tokenizer)
    with make(server.url, tmp_path) as eng:
        server.inject("/v1/completions", "malform", mutate=older_server, times=2)
        assert_same(eng.generate(ps, sp), expected(ref, ps, sp))


def test_faults_every_prompt_answered_once_in_order(server, ref, tokenizer, tmp_path):
    ps, sp = prompts(tokenizer, 8), greedy(tokenizer)
    want = expected(ref, ps, sp)
    with make(server.url, tmp_path, http=HttpSettings(timeout_s=2.0, max_retries=6, backoff_s=0.1, max_in_flight=3)) as eng:
        start = len(server.calls("/v1/completions"))
        server.inject("/v1/completions", "status", status=503)
        server.inject("/v1/completions", "delay", seconds=3.0)
        server.inject("/v1/completions", "drop")
        server.inject("/v1/completions", "restart", seconds=0.2)
        got = eng.generate(ps, sp)
    calls = server.calls("/v1/completions")[start:]
    rids = [c.body["request_id"] for c in calls]
    assert len(set(rids)) == len(ps)
    rid_of = {tuple(c.body["prompt"]): c.body["request_id"] for c in calls}
    assert_same(got, want, served=[server.answers[rid_of[tuple(p)]] for p in ps])
    for i, c in enumerate(calls):
        if c.fault:
            assert c.body["request_id"] in rids[i + 1:], f"request hit by {c.fault} was not retried under the same id"
    assert server.restarts == 1


@pytest.mark.parametrize("reason,expect", [("repetition", "length"), ("error", "error")])
def test_finish_reasons_repetition_and_error(server, tokenizer, tmp_path, reason, expect):
    def set_reason(body):
        body["choices"][0]["finish_reason"] = reason
        return body

    with make(server.url, tmp_path) as eng:
        server.inject("/v1/completions", "malform", mutate=set_reason)
        g = eng.generate(prompts(tokenizer, 1), greedy(tokenizer))[0]
    assert g.finish_reason == expect and (g.token_ids == [] if expect == "error" else len(g.token_ids) > 0)


def test_score_uses_prompt_logprobs(server, ref, model, tokenizer, tmp_path):
    ps = prompts(tokenizer, 3)
    comps = [g.token_ids for g in expected(ref, ps, greedy(tokenizer))]
    with make(server.url, tmp_path) as eng:
        got = eng.score(ps, comps)
    calls = server.calls("/v1/completions")[-3:]
    rid_of = {tuple(c.body["prompt"]): c.body["request_id"] for c in calls}
    assert got == [server.scores[rid_of[tuple(p + c)]][0][len(p) - 1:] for p, c in zip(ps, comps)]  # exact
    want = ref.score(ps, comps)
    tol = model_logprob_tolerance(model, [p + c for p, c in zip(ps, comps)])  # another batch: float32 rounding
    assert [x for g in got for x in g] == pytest.approx([x for w in want for x in w], abs=tol)
    assert calls[0].body["prompt_logprobs"] == 0


@pytest.mark.parametrize("mode,bucket_bytes", [("disk", 1 << 28), ("tensor", 1), ("tensor", 1 << 28),
                                               ("distributed", 1), ("distributed", 1 << 28)])
def test_weight_sync_stage_commit_and_new_version(mode, bucket_bytes, model, server, tokenizer, tmp_path):
    ps, sp = prompts(tokenizer, 3), greedy(tokenizer)
    new = perturbed(model)
    want = answers_of(model, new, ps, sp)
    with make(server.url, tmp_path, weight_sync=mode, bucket_bytes=bucket_bytes) as eng:
        start = len(server.calls())
        eng.update_weights(new, version=1)
        assert eng.version == 1
        sync = [(c.path, c.body.get("method") if isinstance(c.body, dict) else None) for c in server.calls()[start:]]
        got = eng.generate(ps, sp)
    stage = {"disk": ["glmlight_load_path"], "tensor": ["glmlight_load_payload"],
             "distributed": ["glmlight_init_group", "glmlight_update_distributed"]}[mode]
    methods = [m for p, m in sync if p == "/collective_rpc"]
    buckets = len(new) if bucket_bytes == 1 else 1
    assert sync[0] == ("/pause", None)
    assert methods[:-1] == stage[:-1] + [stage[-1]] * buckets + ["glmlight_commit", "glmlight_release"]
    tail = [p for p, _ in sync if p != "/collective_rpc"]
    assert tail[1:4] == ["/update_weight_version", "/reset_prefix_cache", "/resume"]
    assert methods[-1] == "glmlight_weight_version"
    assert_same(got, want)
    assert all(g.versions == [1] * len(g.token_ids) for g in got)
    assert server.worker.glmlight_weight_version()["weight_version"] == "1" and server.weight_version == "1"


def test_a_failed_bucket_leaves_the_previous_version_serving(model, server, tokenizer, tmp_path):
    """The third bucket fails for good: nothing was loaded, the stage is dropped, the update is tried
    again (update_retries) and then the run gets one line; generation goes on with version 0."""
    ps, sp = prompts(tokenizer, 2), greedy(tokenizer)
    before = expected(LocalEngine(model), ps, sp)
    failed = {"error": {"message": "Call to collective_rpc method failed: Worker failed with error 'bad bucket'",
                        "type": "InternalServerError", "param": None, "code": 500}}
    with make(server.url, tmp_path, weight_sync="tensor", bucket_bytes=1, update_retries=1) as eng:
        server.inject("/collective_rpc", "status", after=2, times=100, body=failed,
                      when=lambda b: b.get("method") == "glmlight_load_payload")
        with pytest.raises(EngineError) as err:
            eng.update_weights(perturbed(model), version=1)
        server.faults.clear()
        assert eng.version == 0
        assert_same(eng.generate(ps, sp), before)
        methods = [c.body["method"] for c in server.calls("/collective_rpc") if c.body.get("method") != "glmlight_weight_version"]
    msg = str(err.value)
    assert "\n" not in msg and "failed 2 times" in msg and "every server still serves version 0" in msg
    assert methods.count("glmlight_abort_update") == 2 and "glmlight_commit" not in methods
    assert server.worker.__dict__.get("_gl_staged") is None  # nothing left staged


def test_commit_failure_on_one_server_reverts_the_other(model, tokenizer, tmp_path):
    """Two servers; the second cannot load the update (a shape its model does not have): the first,
    which committed, goes back to the previous weights, so both keep serving version 0."""
    a, b = VLLMServer(LocalEngine(model)).start(), VLLMServer(LocalEngine(model)).start()
    ps, sp = prompts(tokenizer, 2), greedy(tokenizer)
    before = expected(LocalEngine(model), ps, sp)
    try:
        b.worker._gl_expected_shapes = lambda: {k: tuple(v.shape) + (1,) for k, v in model.state_dict().items()}
        with make([a.url, b.url], tmp_path, weight_sync="tensor", update_retries=0) as eng:
            with pytest.raises(EngineError, match="wrong shape"):
                eng.update_weights(perturbed(model), version=1)
            assert eng.version == 0
            assert [c.body["method"] for c in a.calls("/collective_rpc")][-3:] == [
                "glmlight_load_payload", "glmlight_commit", "glmlight_revert"]
            assert_same(eng.generate(ps * 2, sp), before * 2)
            assert a.worker.glmlight_weight_version()["weight_version"] is None
    finally:
        a.close()
        b.close()


def test_reset_prefix_cache_success_false_is_retried(model, server, tokenizer, tmp_path):
    server.cache_busy = 3
    with make(server.url, tmp_path, weight_sync="tensor") as eng:
        eng.update_weights(perturbed(model), version=1)
    assert [c.path for c in server.calls("/reset_prefix_cache")].count("/reset_prefix_cache") == 4


def test_permanent_rpc_errors_are_not_retried(server, tmp_path):
    from glmlight.engines.servers.http import ServerFailed

    with make(server.url, tmp_path, http=HttpSettings(timeout_s=120, max_retries=5, backoff_s=0.2)) as eng:
        n = len(server.calls("/collective_rpc"))
        with pytest.raises(ServerFailed, match="has no attribute 'no_such_method'"):
            eng.http.run(eng.servers[server.url].rpc("no_such_method", None))
        assert len(server.calls("/collective_rpc")) == n + 1 and eng.http.num_retries == 0


def test_a_server_that_acknowledges_weights_it_did_not_load_stops_the_run(model, server, tokenizer, tmp_path):
    from glmlight.engines.servers.protocol import FleetFailed

    with make(server.url, tmp_path, weight_sync="tensor") as eng:
        eng.generate(prompts(tokenizer, 1), greedy(tokenizer))
        eng.update_weights(perturbed(model, seed=1), version=1)
        server.inject("/collective_rpc", "lie", when=lambda b: b.get("method") == "glmlight_commit")
        with pytest.raises(FleetFailed) as err:
            eng.update_weights(perturbed(model, scale=0.3, seed=2), version=2)
        with pytest.raises(FleetFailed):
            eng.generate(prompts(tokenizer, 1), greedy(tokenizer))
    assert "\n" not in str(err.value) and "did not load the new weights" in str(err.value)


def test_raw_logprobs_server_is_refused_at_start(model, tokenizer, tmp_path):
    srv = VLLMServer(LocalEngine(model), logprobs_mode="raw").start()
    try:
        with pytest.raises(EngineError) as err:
            make(srv.url, tmp_path)
        eng = make(srv.url, tmp_path, check_logprobs=False)  # the check can be switched off
        eng.close()
    finally:
        srv.close()
    msg = str(err.value)
    assert "\n" not in msg and "--logprobs-mode processed_logprobs" in msg and "top_k=1" in msg


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


def test_api_key_bearer_refusal_and_unset_variable(model, tokenizer, tmp_path, monkeypatch):
    srv = VLLMServer(LocalEngine(model), api_key="k-123").start()
    plain = VLLMServer(LocalEngine(model)).start()
    monkeypatch.setenv("TEST_VLLM_KEY", "k-123")
    settings = HttpSettings(api_key_env="TEST_VLLM_KEY", timeout_s=120, backoff_s=0.01)
    try:
        eng = make(srv.url, tmp_path, http=settings)
        eng.generate(prompts(tokenizer, 1), greedy(tokenizer))
        eng.close()
        assert all(c.headers.get("Authorization") == "Bearer k-123" for c in srv.calls())
        monkeypatch.setenv("TEST_VLLM_KEY", "bad")
        with pytest.raises(EngineError) as err:
            make(srv.url, tmp_path, http=settings)
        monkeypatch.delenv("TEST_VLLM_KEY")
        with make(plain.url, tmp_path, http=settings) as eng:  # unset: no key, and a keyless server is fine
            assert len(eng.generate(prompts(tokenizer, 1), greedy(tokenizer))) == 1
        assert not any("Authorization" in c.headers for c in plain.calls())
        with pytest.raises(EngineError, match=r"requires an API key .*\$TEST_VLLM_KEY is not set"):
            make(srv.url, tmp_path, http=settings)
    finally:
        srv.close()
        plain.close()
    msg = str(err.value)
    assert "\n" not in msg and srv.url in msg and "refused the API key" in msg and "bad" not in msg


@pytest.mark.parametrize("kind,words", [("html", "not JSON"), ("empty", "empty body")])
def test_a_200_of_another_shape_is_one_line(server, tokenizer, tmp_path, kind, words):
    with make(server.url, tmp_path) as eng:
        server.inject("/v1/completions", kind)
        with pytest.raises(EngineError) as err:
            eng.generate(prompts(tokenizer, 1), greedy(tokenizer))
    msg = str(err.value)
    assert "\n" not in msg and server.url in msg and words in msg and "proxy" in msg


def test_malformed_body_and_missing_server_are_one_line(server, tokenizer, tmp_path):
    def strip(body):
        del body["choices"][0]["logprobs"]["token_logprobs"]
        return body

    with make(server.url, tmp_path) as eng:
        server.inject("/v1/completions", "malform", mutate=strip)
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
        assert isinstance(eng, VLLMEngine) and eng.name == "vLLM-Ascend" and eng.sync.backend == "hccl"
    finally:
        eng.close()


def test_managed_launch_vllm_ascend_with_standin_executable(tokenizer, tmp_path):
    cmd = [sys.executable, standin_script(tmp_path, "vllm")]
    eng = build_server_engine(launch_config(tmp_path, "vllm_ascend", cmd, weight_sync="tensor"))
    try:
        spec = eng.launcher.spec
        assert EXTENSION in spec.command and spec.env["VLLM_SERVER_DEV_MODE"] == "1"
        assert spec.command[spec.command.index("--logprobs-mode") + 1] == "processed_logprobs"
        assert spec.env["PYTHONPATH"].split(os.pathsep)[0] == PACKAGE_ROOT
        assert spec.env.get("VLLM_WORKER_MULTIPROC_METHOD", "spawn") == "spawn"
        # weights stay in ND (vllm-ascend's weight_nz_mode); no setting vLLM 0.23 does not know
        assert json.loads(spec.command[spec.command.index("--additional-config") + 1]) == {"weight_nz_mode": 0}
        assert "VLLM_USE_V1" not in spec.env
        got = eng.generate(prompts(tokenizer, 2), greedy(tokenizer))
        assert len(got) == 2 and all(g.token_ids for g in got)
        from glmlight.models.loading import load_causal_lm

        eng.update_weights(list(load_causal_lm(None, tokenizer, preset="test", seed=1).state_dict().items()), version=1)
        assert eng.version == 1
        server_id = eng.launcher.server_id
        assert len(server_processes(server_id)) >= 3  # the guard, the server and the server's own child
    finally:
        eng.close()
    assert server_processes(server_id) == []


def test_worker_extension_imports_with_torch_and_safetensors_alone(tmp_path):
    """What a vLLM server's environment must provide for the extension: torch, safetensors,
    glmlight on the path; Lightning, Hydra, OmegaConf, transformers and aiohttp made unimportable."""
    blocker = tmp_path / "sitecustomize.py"
    blocker.write_text("import sys\nfor name in ('lightning', 'hydra', 'omegaconf', 'transformers', 'aiohttp', "
                       "'torchmetrics', 'lightning_utilities'):\n    sys.modules[name] = None\n")
    code = ("import sys, glmlight.engines.servers.worker.vllm_extension as w; assert w.WeightLoaderExtension; "
            "print(sorted(m for m in sys.modules if m.startswith('glmlight')))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), REPO])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr[-1500:]
    assert out.stdout.strip() == str(['glmlight', 'glmlight.dtypes', 'glmlight.engines', 'glmlight.engines.servers',
                                      'glmlight.engines.servers.worker', 'glmlight.engines.servers.worker.checks',
                                      'glmlight.engines.servers.worker.vllm_extension',
                                      'glmlight.engines.transport', 'glmlight.engines.weight_delta', 'glmlight.sample'])


@pytest.mark.parametrize("version", ["0.32.0", "0.33.0"])
def test_a_server_that_comes_back_with_other_weights_is_resynced_first(model, tokenizer, tmp_path, version):
    """vLLM 0.33 labels every answer with its weight version; 0.32 does not, so the client asks each
    server for its version before every call. Either way a server that lost its weights is given
    the current ones before it answers."""
    a, b = VLLMServer(LocalEngine(model), version=version).start(), VLLMServer(LocalEngine(model), version=version).start()
    ps, sp = prompts(tokenizer, 4), greedy(tokenizer)
    new = perturbed(model)
    want = answers_of(model, new, ps, sp)
    try:
        with make([a.url, b.url], tmp_path, weight_sync="tensor") as eng:
            eng.update_weights(new, version=1)
            b.reset_state()
            assert_same(eng.generate(ps * 2, sp), want * 2)
            assert eng.num_resyncs == 1 and b.worker.glmlight_weight_version()["weight_version"] == "1"
            b.restart(fresh=True)
            for _ in range(2):
                assert_same(eng.generate(ps * 2, sp), want * 2)
            assert eng.num_resyncs == 2 and eng.version == 1
    finally:
        a.close()
        b.close()


def test_a_connection_dropped_after_a_bucket_was_staged_restarts_the_update(model, server, tokenizer, tmp_path):
    """The answer to the third bucket is lost although the worker staged it: the resent bucket is out
    of order, the worker drops the stage, and the update starts again from the first bucket."""
    ps, sp = prompts(tokenizer, 2), greedy(tokenizer)
    new = perturbed(model, seed=5)
    with make(server.url, tmp_path, weight_sync="tensor", bucket_bytes=1) as eng:
        server.inject("/collective_rpc", "drop_after", after=2, when=lambda b: b.get("method") == "glmlight_load_payload")
        eng.update_weights(new, version=1)
        assert eng.version == 1
        assert_same(eng.generate(ps, sp), answers_of(model, new, ps, sp))
    methods = [c.body["method"] for c in server.calls("/collective_rpc")]
    assert methods.count("glmlight_abort_update") == 1 and methods.count("glmlight_commit") == 1


def test_fp8_weight_format_pushes_the_block_fp8_checkpoint_layout(model, tokenizer, tmp_path):
    """rollout.weight_format=fp8 against a server started from a block-FP8 checkpoint: every push carries
    that checkpoint's names and layout (float8_e4m3fn weights with their weight_scale_inv, experts one by
    one), which the worker extension checks against the server's checkpoint before loading."""
    import json

    from glmlight.models.fp8_checkpoint import fp8_checkpoint_tensors, fp8_quantization_config
    from glmlight.ops.quant import FP8_DTYPE, dequantize_fp8_block

    ckpt = tmp_path / "fp8-ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({"model_type": model.config.model_type,
                                                  "quantization_config": fp8_quantization_config()}))
    layout = fp8_checkpoint_tensors(model.state_dict().items(), model_type=model.config.model_type)
    srv = VLLMServer(LocalEngine(model)).start()
    received: list = []
    srv.worker._gl_expected_shapes = lambda: {k: tuple(v.shape) for k, v in layout}
    srv.worker._gl_reload = lambda named: received.extend(named) or len(named)
    try:
        new = perturbed(model)
        with make(srv.url, tmp_path, weight_sync="tensor", weight_format="fp8", model_path=str(ckpt),
                  verify_updates=False) as eng:
            eng.update_weights(new, version=1)
            assert eng.version == 1
    finally:
        srv.close()
    got = dict(received)
    assert sorted(got) == sorted(k for k, _ in layout)
    fp8 = [k for k, v in got.items() if v.dtype == FP8_DTYPE]
    assert fp8 and all(k + "_scale_inv" in got for k in fp8)
    name = next(k for k in fp8 if ".experts." not in k)
    sent = dict(new)[name]
    back = dequantize_fp8_block(got[name], got[name + "_scale_inv"])
    assert (back - sent).abs().max() <= 0.07 * sent.abs().max()  # e4m3: 3 mantissa bits
    assert not torch.equal(back, dict(model.state_dict())[name])  # the new weights, not the old


def test_disk_push_keeps_the_last_versions(tmp_path):
    """`write_hf_checkpoint` (the disk-mode push) writes root/vN atomically and keeps the newest `keep`."""
    import torch

    from glmlight.engines.transport import checkpoint_versions, read_checkpoint, write_hf_checkpoint

    root = str(tmp_path / "weights")
    assert checkpoint_versions(root) == []
    for v in (1, 2, 10):
        path = write_hf_checkpoint([("w", torch.full((2,), float(v)))], root, v, keep=2)
    assert checkpoint_versions(root) == [2, 10] and path == str(tmp_path / "weights" / "v10")
    assert dict(read_checkpoint(path))["w"].tolist() == [10.0, 10.0]


def _fake_vllm(monkeypatch, device_type: str, weight_nz_mode: int) -> list:
    """vLLM and vllm-ascend as the worker extension sees them inside a vLLM-Ascend worker (the names it
    imports; tests/unit/accelerators/test_npu_wheels.py checks them against vllm-ascend 0.23.0.post1 and vLLM 0.23.0).
    Returns the log of (step, default device) of the layerwise reload."""
    import contextlib
    import types

    seen: list = []
    mods = {name: types.ModuleType(name) for name in (
        "vllm", "vllm.platforms", "vllm.config", "vllm.model_executor", "vllm.model_executor.model_loader",
        "vllm.model_executor.model_loader.reload", "vllm_ascend", "vllm_ascend.ascend_config")}
    mods["vllm.platforms"].current_platform = types.SimpleNamespace(
        device_type=device_type, is_cpu=lambda: device_type == "cpu")
    mods["vllm.config"].set_current_vllm_config = lambda cfg: contextlib.nullcontext()
    reload = mods["vllm.model_executor.model_loader.reload"]
    reload.initialize_layerwise_reload = lambda model: seen.append(("initialize", str(torch.get_default_device())))
    reload.finalize_layerwise_reload = lambda model, cfg: seen.append(("finalize", str(torch.get_default_device())))
    mods["vllm_ascend.ascend_config"].get_ascend_config = lambda: types.SimpleNamespace(weight_nz_mode=weight_nz_mode)
    for name, module in mods.items():
        monkeypatch.setitem(sys.modules, name, module)
    return seen


def _ascend_worker(seen: list, device: str):
    import types

    from glmlight.engines.servers.worker.vllm_extension import WeightLoaderExtension

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(2, 2, bias=False)

        def load_weights(self, weights):
            seen.append(("load_weights", str(torch.get_default_device())))
            names = set()
            for name, t in weights:
                self.get_parameter(name).copy_(t)
                names.add(name)
            return names

    class Worker(WeightLoaderExtension):
        def __init__(self, model):
            self.model_runner = types.SimpleNamespace(get_model=lambda: model)
            self.vllm_config = types.SimpleNamespace(model_config=types.SimpleNamespace(model="/no/such/checkpoint"))
            self.device = torch.device(device)
            self.rank = 0

    model = Model()
    return Worker(model), model


def test_worker_extension_on_vllm_ascend_reloads_on_the_npu_and_refuses_nz_weights(monkeypatch):
    """What vllm-ascend's own weight update does (NPUWorker.start_weight_update / finish_weight_update):
    the layerwise reload under the worker's device, and no update of weights vllm-ascend cast to
    FRACTAL_NZ. The stand-in's "meta" device shows which default device the reload ran under."""
    new = [("proj.weight", torch.full((2, 2), 3.0))]
    seen = _fake_vllm(monkeypatch, "npu", weight_nz_mode=0)
    worker, model = _ascend_worker(seen, "meta")
    assert "problem" not in worker.glmlight_weight_version()
    worker.load_named_tensors(new, version=1)
    assert seen == [("initialize", "meta"), ("load_weights", "meta"), ("finalize", "meta")]
    assert torch.equal(model.proj.weight, new[0][1]) and worker.glmlight_weight_version()["weight_version"] == "1"

    seen = _fake_vllm(monkeypatch, "npu", weight_nz_mode=1)
    worker, model = _ascend_worker(seen, "meta")
    before = model.proj.weight.detach().clone()
    problem = worker.glmlight_weight_version()["problem"]
    assert "weight_nz_mode=1" in problem and '''--additional-config '{"weight_nz_mode": 0}\'''' in problem
    with pytest.raises(RuntimeError, match="FRACTAL_NZ"):
        worker.load_named_tensors(new, version=1)
    assert seen == [] and torch.equal(model.proj.weight, before)

    seen = _fake_vllm(monkeypatch, "cpu", weight_nz_mode=1)  # not vLLM-Ascend: its settings are not consulted
    worker, model = _ascend_worker(seen, "meta")
    assert "problem" not in worker.glmlight_weight_version()
    worker.load_named_tensors(new, version=1)
    assert seen == [("initialize", "cpu"), ("load_weights", "cpu"), ("finalize", "cpu")]


def test_a_vllm_ascend_server_with_nz_weights_is_named_at_the_first_update(model, tokenizer, tmp_path, monkeypatch):
    """The stand-in server's workers (the real extension) on vLLM-Ascend with weight_nz_mode=1: the client
    refuses the update with the workers' line before sending any weights."""
    _fake_vllm(monkeypatch, "npu", weight_nz_mode=1)
    line = "vLLM-Ascend casts this model's weights to the FRACTAL_NZ format (weight_nz_mode=1)"
    srv = VLLMServer(LocalEngine(model)).start()
    try:
        with make(srv.url, tmp_path, weight_sync="tensor") as eng:
            assert len(eng.generate(prompts(tokenizer, 1), greedy(tokenizer))) == 1
            with pytest.raises(EngineError) as err:
                eng.update_weights(list(model.state_dict().items()), version=1)
    finally:
        srv.close()
    assert "\n" not in str(err.value) and srv.url in str(err.value) and line in str(err.value)


def test_in_process_vllm_ascend_engine_keeps_weights_in_nd(monkeypatch):
    import types

    from glmlight.engines.servers.vllm.inprocess import VLLMInProcessEngine

    built: dict = {}
    fake = types.ModuleType("vllm")
    fake.LLM = lambda **kwargs: built.update(kwargs)
    monkeypatch.setitem(sys.modules, "vllm", fake)
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "")  # restored (or removed) after the test
    monkeypatch.delenv("VLLM_WORKER_MULTIPROC_METHOD")
    VLLMInProcessEngine("/ckpt", ascend=True)
    assert built["additional_config"] == {"weight_nz_mode": 0} and built["distributed_executor_backend"] == "mp"
    assert built["worker_extension_cls"] == EXTENSION and os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"
    built.clear()
    VLLMInProcessEngine("/ckpt", ascend=True, llm_kwargs={"additional_config": {"weight_nz_mode": 0, "x": 1}})
    assert built["additional_config"] == {"weight_nz_mode": 0, "x": 1}  # the caller's own wins


def test_delta_sync_sends_the_changed_elements_and_goes_whole_when_a_server_lacks_the_base(model, tokenizer, tmp_path):
    """weight_sync=tensor with delta_sync: the first update goes whole; one that changes a few elements
    sends a bitmask and those values, and both servers rebuild exactly the trainer's weights. A server
    that restarted (no base) is re-synced whole; a failed update makes the next one whole again."""
    from glmlight.engines.weight_delta import MASK

    a, b = VLLMServer(LocalEngine(model)).start(), VLLMServer(LocalEngine(model)).start()
    ps, sp = prompts(tokenizer, 4), greedy(tokenizer)
    v1 = perturbed(model, seed=1)
    v2 = [(k, t.clone()) for k, t in v1]
    name, t = next((k, t) for k, t in v2 if t.dim() == 2)
    t[0, :3] += 0.5  # three elements of one matrix
    full = sum(t.numel() * t.element_size() for _, t in v1)

    def sent_names(srv, start=0):  # the tensor names of every bucket the server was sent since call `start`
        from glmlight.engines.transport import decode_safetensors
        return [n for c in srv.calls("/collective_rpc")[start:] if c.body.get("method") == "glmlight_load_payload"
                for n, _ in decode_safetensors(json.loads(c.body["args"][0])["data"])]

    try:
        with make([a.url, b.url], tmp_path, weight_sync="tensor", delta_sync=True) as eng:
            eng.update_weights(v1, version=1)
            assert eng.last_sync_bytes["bytes"] == full and not any(n.endswith(MASK) for n in sent_names(a))
            n = len(a.calls("/collective_rpc"))
            eng.update_weights(v2, version=2)
            assert eng.last_sync_bytes["changed"] == 3 and eng.last_sync_bytes["bytes"] < full / 5
            names = sent_names(a, n)
            assert name + MASK in names and name not in names
            want = answers_of(model, v2, ps, sp)
            assert_same(eng.generate(ps * 2, sp), want * 2)  # both servers serve exactly v2
            b.restart(fresh=True)  # comes back without the weights, and without a base
            assert_same(eng.generate(ps * 2, sp), want * 2)
            assert eng.num_resyncs == 1 and b.worker.__dict__["_gl_delta_base"]["version"] == "2"
            failed = {"error": {"message": "Call to collective_rpc method failed: Worker failed with error 'x'",
                                "type": "InternalServerError", "param": None, "code": 500}}
            a.inject("/collective_rpc", "status", times=1, body=failed,
                     when=lambda body: body.get("method") == "glmlight_commit")
            v3 = [(k, t + (0.25 if k == name else 0.0)) for k, t in v2]
            eng.update_weights(v3, version=3)  # the first try fails; the retry goes whole
            assert eng.version == 3 and eng.last_sync_bytes["bytes"] == full
            assert_same(eng.generate(ps * 2, sp), answers_of(model, v3, ps, sp) * 2)
    finally:
        a.close()
        b.close()


# A server that passes its health check and dies on its first request, printing its worker's error as vLLM's
# CPU build does for an MLA model whose latent width its MLA backend does not take (vllm 0.32.0,
# model_executor/layers/attention/mla_attention.py).
DIES_ON_FIRST_REQUEST = '''
import http.server, os, sys
class H(http.server.BaseHTTPRequestHandler):
    def log_message(self, *a): pass
    def do_GET(self):
        if self.path.startswith("/health"):
            self.send_response(200); self.end_headers(); self.wfile.write(b"ok"); return
        self.die()
    def do_POST(self): self.die()
    def die(self):
        print("(Worker pid=1) ERROR [multiproc_executor.py:1063] ValueError: Head dimension 24 is not supported by MLA.")
        print("(EngineCore pid=2) ERROR [core.py:1512] RuntimeError: Worker failed with error 'Head dimension 24'")
        print("UserWarning: resource_tracker: leaked semaphore objects", flush=True)
        os._exit(1)
port = int(sys.argv[sys.argv.index("--port") + 1])
http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
'''


def test_a_managed_server_that_dies_on_its_first_request_is_reported_with_its_error(tmp_path):
    """Not the client's symptom (a refused connection) but the server's exit and its root cause, one line."""
    script = tmp_path / "dies.py"
    script.write_text(DIES_ON_FIRST_REQUEST)
    with pytest.raises(EngineError) as err:
        build_server_engine(launch_config(tmp_path, "vllm", [sys.executable, str(script)]))
    msg = str(err.value)
    assert "\n" not in msg
    assert "exited with code 1: ValueError: Head dimension 24 is not supported by MLA." in msg
