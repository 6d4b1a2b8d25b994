"""SGLangEngine against the SGLang 0.5.23 stand-in (tests/support/standin_sglang.py), backed by the embedded
engine: answers must equal what the embedded engine computes for the same requests, exactly once
and in order, also under injected faults. (The real SGLang 0.5.23 on CPU:
tests/integration/servers/test_real_servers.py.)"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading
import time

import pytest
import torch

from glmlight.errors import ConfigError, EngineError
from glmlight.engines.base import SamplingParams
from glmlight.engines.factory import build_server_engine
from glmlight.engines.servers.http import HttpSettings
from glmlight.engines.servers.launch import free_port, server_processes
from glmlight.engines.local.engine import LocalEngine
from glmlight.engines.servers.sglang.engine import SGLangEngine
from tests.support.protocol_servers import (  # noqa: F401  (model, ref: shared fixtures)
    SGLangServer, answers_of, assert_same, expected, greedy, launch_config, model, perturbed, prompts, ref,
    standin_script)
from tests.support.tolerances import model_logprob_tolerance
from tests.support.waiting import wait_event, wait_until


@pytest.fixture()
def server(model):
    srv = SGLangServer(LocalEngine(model)).start()
    yield srv
    srv.close()


def make(url_or_urls, tmp_path, **kw) -> SGLangEngine:
    http = kw.pop("http", HttpSettings(timeout_s=120, max_retries=3, backoff_s=0.01))
    urls = [url_or_urls] if isinstance(url_or_urls, str) else url_or_urls
    return SGLangEngine(urls, http=http, ready_timeout_s=120, weight_sync_dir=str(tmp_path / "w"),
                        sync_backend="gloo", **kw)


def _generate_calls(server, start=0):
    return [c for c in server.calls("/generate")[start:] if c.body.get("sampling_params", {}).get("max_new_tokens")]


class HeldDecoding:
    """Stops the stand-in's decode thread `steps` decode steps after `rows` more requests were admitted,
    until `release()`: they then stay in flight, with the tokens they have, for as long as a test needs.
    Aborts and weight updates do not need the decode thread, so they go on."""

    def __init__(self, engine: LocalEngine, rows: int = 1, steps: int = 3):
        self.engine, self.held, self.released = engine, threading.Event(), threading.Event()
        target, since = engine.stats()["admitted"] + rows, []

        def hook(iteration: int) -> None:
            if not since and engine.stats()["admitted"] >= target:
                since.append(iteration)
            if since and iteration >= since[0] + steps and not self.released.is_set():
                self.held.set()
                self.released.wait()

        engine.on_step = hook

    def release(self) -> None:
        self.released.set()
        self.engine.on_step = None


def _post(url: str, path: str, body: dict, timeout_s: float = 120) -> tuple[int, dict | None]:
    import json
    import urllib.error
    import urllib.request

    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            raw = r.read()
            return r.status, json.loads(raw) if raw else None
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def test_generate_equals_embedded_engine_in_order(server, ref, tokenizer, tmp_path):
    ps, sp = prompts(tokenizer, 6), greedy(tokenizer)
    with make(server.url, tmp_path) as eng:
        start = len(server.calls("/generate"))
        got = eng.generate(ps, sp)
    calls = server.calls("/generate")[start:]
    assert len(calls) == 6 and len({c.body["rid"] for c in calls}) == 6
    rid_of = {tuple(c.body["input_ids"]): c.body["rid"] for c in calls}
    assert_same(got, expected(ref, ps, sp), served=[server.answers[rid_of[tuple(p)]] for p in ps])
    assert all(g.versions == [0] * len(g.token_ids) for g in got)
    body = calls[0].body
    assert body["return_logprob"] is True and body["sampling_params"]["top_k"] == -1 and "return_sampling_mask" not in body
    assert body["sampling_params"]["no_stop_trim"] is True and body["sampling_params"]["skip_special_tokens"] is False
    assert "Authorization" not in calls[0].headers


@pytest.mark.parametrize("top_k,top_p", [(5, 1.0), (5, 0.9), (1, 1.0)])
def test_topk_topp_logprobs_are_the_renormalised_ones(server, model, tokenizer, tmp_path, top_k, top_p):
    """SGLang's output_token_logprobs are before top-k/top-p; the client asks for the sampling
    mask's renormalised log-probs, which equal the embedded engine's sampling with SGLang's joint
    top-k/top-p order (glmlight/ops/logprobs.py), the order the engine declares."""
    ps = prompts(tokenizer, 3)
    sp = SamplingParams(temperature=0.8, top_k=top_k, top_p=top_p, max_new_tokens=6, seed=4)
    with make(server.url, tmp_path) as eng:
        got = eng.generate(ps, sp)
        assert eng.filter_order == "joint"
    assert all(c.body["return_sampling_mask"] for c in _generate_calls(server)[-3:])
    joint = LocalEngine(model)
    joint.filter_order = joint._batch.filter_order = "joint"
    try:
        assert_same(got, expected(joint, ps, sp))
    finally:
        joint.close()


def test_top_p_without_top_k_is_refused_at_start(tmp_path):
    from glmlight.config.schema import validate

    cfg = validate({"rollout": {"backend": "sglang", "top_p": 0.9, "server": {"urls": ["http://127.0.0.1:1"]}}})
    with pytest.raises(ConfigError) as err:
        build_server_engine(cfg)
    assert "\n" not in str(err.value) and "rollout.top_k" in str(err.value) and "return_sampling_mask" in str(err.value)


def test_faults_every_prompt_answered_once_in_order(server, ref, tokenizer, tmp_path):
    """500s, a timeout, a dropped connection and a restart mid-run: nothing lost, nothing doubled;
    every retry has its own rid (SGLang refuses a rid it still holds)."""
    ps, sp = prompts(tokenizer, 8), greedy(tokenizer)
    want = expected(ref, ps, sp)
    with make(server.url, tmp_path, http=HttpSettings(timeout_s=2.0, max_retries=6, backoff_s=0.1, max_in_flight=3)) as eng:
        start = len(server.calls("/generate"))
        server.inject("/generate", "status", status=500, times=2)
        server.inject("/generate", "delay", seconds=3.0)
        server.inject("/generate", "drop")
        server.inject("/generate", "restart", seconds=0.2)
        got = eng.generate(ps, sp)
    calls = server.calls("/generate")[start:]
    logical = {c.body["rid"].rsplit("-", 1)[0] for c in calls}
    assert len(logical) == len(ps) and len({c.body["rid"] for c in calls}) == len(calls)
    rid_of = {tuple(c.body["input_ids"]): c.body["rid"] for c in calls if not c.fault}
    assert_same(got, want, served=[server.answers[rid_of[tuple(p)]] for p in ps])
    assert sorted(c.fault for c in calls if c.fault) == ["delay", "drop", "restart", "status", "status"]
    assert server.restarts == 1 and eng.http.num_retries >= 5


def test_a_retry_while_the_first_attempt_is_still_held_gets_a_fresh_rid(server, ref, tokenizer, tmp_path):
    """The first attempt times out on the client but is still running on the server: resending the
    same rid would be answered 400 "Duplicate request ID" (a 4xx, never retried)."""
    ps, sp = prompts(tokenizer, 1), greedy(tokenizer)
    with make(server.url, tmp_path, http=HttpSettings(timeout_s=1.0, max_retries=2, backoff_s=0.01)) as eng:
        start = len(server.calls("/generate"))
        server.inject("/generate", "slow", seconds=2.5)
        assert_same(eng.generate(ps, sp), expected(ref, ps, sp))
        rids = [c.body["rid"] for c in server.calls("/generate")[start:]]
        assert len(rids) == 2 and rids[0] != rids[1] and rids[0][:-3] == rids[1][:-3]
        assert [c.body for c in server.calls("/abort_request")] == [{"rid": rids[0]}]
        # the abort came while the first attempt had not reached the scheduler yet (SGLang's HTTP process
        # forwards it; the scheduler has nothing of that rid to end): it runs to its end
        wait_until(lambda: server.answers.get(rids[0]), what="the first attempt's own answer")
    assert server.answers[rids[0]][0].finish_reason != "abort"


def test_an_attempt_given_up_on_is_ended_on_the_server_with_its_partial_answer(server, ref, model, tokenizer,
                                                                             tmp_path):
    """An attempt with no answer in time is dropped with /abort_request {its rid} before the retry: SGLang
    ends that request at once, finish_reason abort with the tokens it has
    (tests/integration/servers/test_real_servers.py checks this against the real server); the retry, under
    a fresh rid, is answered in full."""
    ps, sp = prompts(tokenizer, 1), SamplingParams(temperature=1.0, max_new_tokens=40, seed=2)
    with make(server.url, tmp_path, http=HttpSettings(timeout_s=2.0, max_retries=3, backoff_s=0.01)) as eng:
        hold, box = HeldDecoding(server.engine), {}
        t = threading.Thread(target=lambda: box.setdefault("g", eng.generate(ps, sp)[0]))
        t.start()
        try:
            wait_until(lambda: server.calls("/abort_request"), alive=t.is_alive, what="the client giving up")
            first = server.calls("/abort_request")[0].body["rid"]
            wait_until(lambda: server.answers.get(first), alive=t.is_alive, what="the attempt ended on the server")
            assert hold.held.is_set() and server.engine.stats()["aborted"] == 1
        finally:
            hold.release()
            t.join()
    ended = server.answers[first][0]
    assert ended.finish_reason == "abort" and 0 < len(ended.token_ids) < 40
    tol = model_logprob_tolerance(model, [ps[0] + ended.token_ids])  # the sampled and the scored forward
    assert ended.logprobs == pytest.approx(ref.score(ps, [ended.token_ids])[0], abs=tol)
    last = _generate_calls(server)[-1].body["rid"]
    assert last != first and last[:-3] == first[:-3]  # the retry: the same logical request, a fresh rid
    assert_same([box["g"]], expected(ref, ps, sp), served=[server.answers[last]])


def test_abort_request_ends_every_request_whose_rid_starts_with_a_held_one(server, tokenizer):
    """SGLang's rule, which glmlight's fixed-length rids (never a prefix of one another) rely on: the HTTP
    process forwards an abort only for a rid it holds, and the scheduler then ends every request whose
    rid starts with it; the answers are 200 with the tokens so far and finish_reason abort."""
    p = prompts(tokenizer, 1)[0]
    rids = ["job-1", "job-10", "job-2"]
    out: dict[str, tuple] = {}

    def send(rid: str) -> None:
        out[rid] = _post(server.url, "/generate", {"rid": rid, "input_ids": p, "return_logprob": True,
                                                   "sampling_params": {"max_new_tokens": 40, "temperature": 0.0}})

    threads = [threading.Thread(target=send, args=(rid,)) for rid in rids]
    hold = HeldDecoding(server.engine, rows=3)
    try:
        with server.engine._turn:  # the decode thread waits before its next step: the three start together
            for t in threads:
                t.start()
            wait_until(lambda: server.in_flight == 3, alive=lambda: all(t.is_alive() for t in threads),
                       what="three requests in the engine")
        wait_event(hold.held, alive=lambda: all(t.is_alive() for t in threads), what="three requests decoding")
        assert _post(server.url, "/abort_request", {"rid": "job"}) == (200, None)  # no request has that rid
        assert _post(server.url, "/abort_request", {"rid": ""}) == (200, None)  # ignored (not abort_all)
        assert _post(server.url, "/abort_request", {"rid": "job-1"}) == (200, None)
        wait_until(lambda: "job-1" in out and "job-10" in out, alive=lambda: threads[2].is_alive(),
                   what="job-1 and job-10 ended")
        assert "job-2" not in out
    finally:
        hold.release()
        for t in threads:
            t.join()
    for rid in rids:
        status, body = out[rid]
        meta = body["meta_info"]
        assert status == 200 and meta["completion_tokens"] == len(body["output_ids"])
        if rid == "job-2":
            assert meta["finish_reason"] == {"type": "length", "length": 40}
        else:
            assert meta["finish_reason"] == {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
            assert 0 < len(body["output_ids"]) < 40


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


def test_score_equals_embedded_engine(server, ref, model, tokenizer, tmp_path):
    ps = prompts(tokenizer, 3)
    comps = [g.token_ids for g in expected(ref, ps, greedy(tokenizer))] + [[]]
    ps = ps + [ps[0]]
    with make(server.url, tmp_path) as eng:
        start = len(server.calls("/generate"))
        got = eng.score(ps, comps)
    calls = server.calls("/generate")[start:]
    rid_of = {tuple(c.body["input_ids"]): c.body["rid"] for c in calls}
    assert got[:3] == [server.scores[rid_of[tuple(p + c)]][0] for p, c in zip(ps[:3], comps)]  # exact transport
    assert got[3] == []  # an empty completion needs no request
    want = ref.score(ps, comps)
    tol = model_logprob_tolerance(model, [p + c for p, c in zip(ps, comps)])  # another batch: float32 rounding
    assert [x for g in got for x in g] == pytest.approx([x for w in want for x in w], abs=tol)
    assert calls[0].body["logprob_start_len"] == len(ps[0]) - 1 and calls[0].body["sampling_params"]["max_new_tokens"] == 0


@pytest.mark.parametrize("mode", ["disk", "tensor", "distributed"])
def test_weight_sync_in_a_session_and_new_version(mode, model, server, tokenizer, tmp_path):
    ps, sp = prompts(tokenizer, 3), greedy(tokenizer)
    new = perturbed(model)
    want = answers_of(model, new, ps, sp)
    server.version_lag_s = 0.2 if mode == "disk" else 0.0
    with make(server.url, tmp_path, weight_sync=mode) as eng:
        start = len(server.calls())
        eng.update_weights(new, version=1)
        assert eng.version == 1
        sync = [p for p in server.paths()[start:] if p != "/model_info"]
        got = eng.generate(ps, sp)
        if mode == "distributed":  # the group is set up once; a second sync reuses it
            eng.update_weights(new, version=2)
            assert eng.version == 2 and len(server.calls("/init_weights_update_group")) == 1
    update = {"disk": ["/update_weights_from_disk"],
              "tensor": ["/server_info", "/begin_weight_update", "/update_weights_from_tensor", "/end_weight_update"],
              "distributed": ["/server_info", "/begin_weight_update", "/init_weights_update_group",
                              "/update_weights_from_distributed", "/end_weight_update"]}[mode]
    assert sync[: len(update) + 3] == ["/pause_generation", *update, "/flush_cache", "/continue_generation"]
    assert_same(got, want)
    assert all(g.versions == [1] * len(g.token_ids) for g in got)
    if mode == "disk":
        assert len(server.calls("/model_info")) >= 2  # polled until the server reported the new version
        assert os.path.isfile(tmp_path / "w" / "v1" / "model.safetensors")
        assert server.calls("/update_weights_from_disk")[0].body["weight_version"] == "1"


def test_tensor_payloads_open_in_a_separately_started_server_process(model, server, tokenizer, tmp_path):
    """The stand-in unpickles with SGLang's restricted unpickler in a process of its own: the shared
    memory the payload names must be openable there (file_system strategy), and nothing outside
    SGLang's allow-list may be referenced."""
    ps, sp = prompts(tokenizer, 2), greedy(tokenizer)
    new = perturbed(model, seed=3)
    with make(server.url, tmp_path, weight_sync="tensor", bucket_bytes=1 << 14) as eng:
        eng.update_weights(new, version=1)
        assert_same(eng.generate(ps, sp), answers_of(model, new, ps, sp))
    assert len(server.calls("/update_weights_from_tensor")) > 3 and server._decoder.pid != os.getpid()


@pytest.mark.parametrize("path", ["/update_weights_from_tensor", "/update_weights_from_distributed"])
def test_updates_outside_a_session_are_refused_like_sglang(server, path):
    import json
    import urllib.error
    import urllib.request

    body = {"serialized_named_tensors": [""], "names": [], "dtypes": [], "shapes": []}
    req = urllib.request.Request(server.url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=10)
    assert err.value.code == 400
    assert json.loads(err.value.read())["message"] == f"{path[1:]} must run between begin_weight_update() and end_weight_update()"


def test_a_failed_update_on_one_server_puts_the_other_back(model, tokenizer, tmp_path):
    a, b = SGLangServer(LocalEngine(model)).start(), SGLangServer(LocalEngine(model)).start()
    ps, sp = prompts(tokenizer, 2), greedy(tokenizer)
    before = expected(LocalEngine(model), ps, sp)
    try:
        with make([a.url, b.url], tmp_path, update_retries=1, model_path=None) as eng:
            eng.update_weights(list(model.state_dict().items()), version=1)  # v1 = the initial weights
            b.inject("/update_weights_from_disk", "status", status=400, times=2,
                     body={"success": False, "message": "Failed to update weights: injected"})
            with pytest.raises(EngineError) as err:
                eng.update_weights(perturbed(model), version=2)
            assert eng.version == 1 and a.weight_version == b.weight_version == "1"
            assert_same(eng.generate(ps * 2, sp), before * 2)
        loads = [c.body["model_path"].rsplit("/", 1)[-1] for c in a.calls("/update_weights_from_disk")]
        assert loads == ["v1", "v2", "v1", "v2", "v1"]  # each failed try put a back on v1
    finally:
        a.close()
        b.close()
    assert "\n" not in str(err.value) and "every server still serves version 1" in str(err.value)


def test_failed_update_keeps_version_and_resumes(server, model, tmp_path):
    server.inject("/update_weights_from_disk", "status", status=400, times=10)
    with make(server.url, tmp_path, update_retries=0, model_path=str(tmp_path)) as eng:
        with pytest.raises(EngineError, match="rejected /update_weights_from_disk with HTTP 400"):
            eng.update_weights(list(model.state_dict().items()), version=1)
        assert eng.version == 0
    assert server.paths()[-1] == "/continue_generation" and server.running.is_set()


@pytest.mark.parametrize("mode", ["disk", "tensor", "distributed"])
def test_an_update_waits_for_the_running_requests_unless_the_server_is_paused(mode, model, server, ref, tokenizer,
                                                                              tmp_path):
    """SGLang runs an update (and, for tensor and distributed, the session calls around it) sent while not
    paused under its model-update writer lock: it waits until the requests in flight have answered, and
    those are served by the old weights to their end. glmlight pauses with mode abort first, so its update
    does not wait: it completes while the running request cannot take a step, and that request comes back
    aborted with its partial tokens."""
    ps, sp = prompts(tokenizer, 1), SamplingParams(temperature=1.0, max_new_tokens=40, seed=2)
    v1, v2 = perturbed(model, seed=1), perturbed(model, seed=2)
    with make(server.url, tmp_path, weight_sync=mode, model_path=None) as eng:
        # glmlight's update: pause (abort), update, resume, while the generation is held mid-way
        hold, box = HeldDecoding(server.engine), {}
        gen = threading.Thread(target=lambda: box.setdefault("paused", eng.generate(ps, sp)[0]))
        gen.start()
        try:
            wait_event(hold.held, alive=gen.is_alive, what="the generation under way")
            eng.update_weights(v1, version=1)
            assert not hold.released.is_set() and eng.version == 1 and server.weight_version == "1"
            gen.join()
        finally:
            hold.release()
            gen.join()
        assert box["paused"].finish_reason == "abort" and 0 < len(box["paused"].token_ids) < 40

        # the same update sent without a pause: it waits for the held generation
        hold = HeldDecoding(server.engine)
        gen = threading.Thread(target=lambda: box.setdefault("served", eng.generate(ps, sp)[0]))
        push = threading.Thread(target=lambda: box.setdefault(
            "source", eng.sync.push([eng.servers[server.url]], v2, None, 2, eng._current)))
        gen.start()
        try:
            wait_event(hold.held, alive=gen.is_alive, what="the generation under way")
            push.start()
            wait_until(lambda: server.update_lock.waiting_writers == 1, alive=push.is_alive,
                       what="the update waiting for the running request")
            name, tensor = v1[0]
            assert server.weight_version == "1" and not server.session_open
            assert torch.equal(server.engine.model.state_dict()[name], tensor)  # nothing of v2 loaded yet
        finally:
            hold.release()
            gen.join()
            if push.is_alive() or "source" not in box:
                push.join()
    assert box["source"].version == 2 and server.weight_version == "2"
    assert_same([box["served"]], answers_of(model, v1, ps, sp))  # served by version 1 to its end
    assert box["served"].versions == [1] * 40
    assert_same(server.engine.generate(ps, sp), answers_of(model, v2, ps, sp))  # and then version 2 serves


def test_a_tensor_payload_sglang_cannot_unpickle_kills_the_managed_server_named_in_one_line(tokenizer, tmp_path):
    """The same steps as against the real SGLang (tests/integration/servers/test_real_servers.py): its
    scheduler dies of a payload the restricted unpickler refuses and the server kills its process tree, so
    the update gets no answer and the next call says in one line that the managed server exited (signal 9),
    with its log's last lines; nothing of the server is left."""
    import base64
    import pickle

    cmd = [sys.executable, standin_script(tmp_path, "sglang")]
    eng = build_server_engine(launch_config(tmp_path, "sglang", cmd, launch_restarts=0))
    try:
        bad = base64.b64encode(pickle.dumps([("model.norm.weight", pickle.PicklingError)])).decode()
        eng.http.run(eng.http.request("/begin_weight_update", {}, url=eng.urls[0], allow_404=True))
        with pytest.raises(EngineError) as lost:
            eng.http.run(eng.http.request("/update_weights_from_tensor", {"serialized_named_tensors": [bad]},
                                          url=eng.urls[0], attempts=1, timeout_s=60))
        eng.launcher.proc.wait()  # the server went down
        with pytest.raises(EngineError) as err:
            eng.generate(prompts(tokenizer, 1), greedy(tokenizer))
    finally:
        eng.close()
    assert server_processes(eng.launcher.server_id) == []
    assert "\n" not in str(lost.value) and eng.urls[0] in str(lost.value)
    msg = str(err.value)
    assert "\n" not in msg and "managed SGLang server exited with signal 9" in msg and "Blocked unsafe global" in msg


def test_an_unloadable_tensor_payload_takes_an_in_process_stand_in_down(server, tokenizer, tmp_path):
    """In the test process the stand-in cannot kill itself: it dies as seen from outside, every connection
    dropped (the update's, and a generation's left running by a pause in place) and the port refused
    from then on; the client's calls fail with one line naming the server."""
    import base64
    import pickle

    bad = base64.b64encode(pickle.dumps([("model.norm.weight", pickle.PicklingError)])).decode()
    http = HttpSettings(timeout_s=120, max_retries=1, backoff_s=0.01)
    with make(server.url, tmp_path, weight_sync="tensor", http=http) as eng:
        hold, box = HeldDecoding(server.engine), {}

        def generate() -> None:
            try:
                eng.generate(prompts(tokenizer, 1), SamplingParams(temperature=1.0, max_new_tokens=40, seed=2))
            except EngineError as e:
                box["error"] = e

        gen = threading.Thread(target=generate)
        gen.start()
        try:
            wait_event(hold.held, alive=gen.is_alive, what="a generation under way")
            eng.http.run(eng.http.request("/pause_generation", {"mode": "in_place"}, url=server.url, expect_json=False))
            eng.http.run(eng.http.request("/begin_weight_update", {}, url=server.url))
            with pytest.raises(EngineError) as lost:
                eng.http.run(eng.http.request("/update_weights_from_tensor", {"serialized_named_tensors": [bad]},
                                              url=server.url, attempts=1))
            gen.join()
        finally:
            hold.release()
            gen.join()
        wait_until(lambda: server._runner is None, what="the stand-in to stop serving")
        assert server.dead and server._decoder.poll() is not None
        with pytest.raises(EngineError) as err:
            eng.generate(prompts(tokenizer, 1), greedy(tokenizer))
    for e in (lost.value, box["error"], err.value):
        assert "\n" not in str(e) and server.url in str(e), str(e)
    print(f"\nthe update: {lost.value}\nthe generation in flight: {box['error']}\nthe next call: {err.value}")


def test_pause_aborts_in_flight_generation_with_its_partial_answer(server, ref, model, tokenizer, tmp_path):
    """SGLang's /pause_generation (abort) ends a running request early: its partial tokens come
    back with finish_reason abort and the log-probs they were sampled with."""
    ps = prompts(tokenizer, 1)
    sp = SamplingParams(temperature=1.0, max_new_tokens=400, seed=2)
    with make(server.url, tmp_path) as eng:
        box = {}
        t = threading.Thread(target=lambda: box.setdefault("g", eng.generate(ps, sp)[0]))
        t.start()
        tokens = server.engine.stats()["tokens"]
        while server.in_flight == 0 or server.engine.stats()["tokens"] < tokens + 2:  # it has decoded
            time.sleep(0.001)
        eng.http.run(eng.servers[server.url].pause())
        t.join(30)
        eng.http.run(eng.servers[server.url].resume())
    g = box["g"]
    assert g.finish_reason == "abort" and 0 < len(g.token_ids) < 400
    tol = model_logprob_tolerance(model, [ps[0] + g.token_ids])  # decoded step by step vs one scoring forward
    assert g.logprobs == pytest.approx(ref.score(ps, [g.token_ids])[0], abs=tol)


def test_api_key_sent_as_bearer(model, tokenizer, tmp_path, monkeypatch):
    srv = SGLangServer(LocalEngine(model), api_key="s3cret-key").start()
    monkeypatch.setenv("TEST_SGLANG_KEY", "s3cret-key")
    try:
        eng = make(srv.url, tmp_path, http=HttpSettings(api_key_env="TEST_SGLANG_KEY", timeout_s=120, backoff_s=0.01))
        eng.generate(prompts(tokenizer, 2), greedy(tokenizer))
        eng.update_weights(list(model.state_dict().items()), version=1)
        eng.close()
        calls = srv.calls()
        assert calls and all(c.headers.get("Authorization") == "Bearer s3cret-key" for c in calls)
        monkeypatch.setenv("TEST_SGLANG_KEY", "not-the-key")
        with pytest.raises(EngineError) as err:
            make(srv.url, tmp_path, http=HttpSettings(api_key_env="TEST_SGLANG_KEY", timeout_s=120, backoff_s=0.01))
    finally:
        srv.close()
    msg = str(err.value)
    assert "\n" not in msg and srv.url in msg and "refused the API key" in msg and "not-the-key" not in msg


def test_malformed_body_names_url_and_field(server, tokenizer, tmp_path):
    def strip(body):
        del body["meta_info"]["output_token_logprobs"]
        return body

    with make(server.url, tmp_path) as eng:
        server.inject("/generate", "malform", mutate=strip)
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
    eng = build_server_engine(launch_config(tmp_path, "sglang", cmd, launch_restarts=0))
    try:
        got = eng.generate(prompts(tokenizer, 2), greedy(tokenizer))
        assert len(got) == 2 and all(g.token_ids for g in got)
        guard = eng.launcher.proc.pid
        server = [p for p in server_processes(eng.launcher.server_id) if p != guard][0]
        os.kill(server, signal.SIGKILL)  # the server dies mid-run: the next call says so
        eng.launcher.proc.wait()
        with pytest.raises(EngineError, match="exited with signal 9"):
            eng.generate(prompts(tokenizer, 1), greedy(tokenizer))
    finally:
        eng.close()
    assert server_processes(eng.launcher.server_id) == []  # the server's own child went too
    with open(eng.launcher.spec.log_path) as f:
        assert "stand-in sglang server ready" in f.read()


def test_a_managed_server_that_dies_is_started_again_and_resynced_before_it_answers(model, tokenizer, tmp_path):
    """kill -9 of a managed server: the next call starts it again on the same address, waits for it,
    gives it the current weights and only then sends the request; past rollout.server.launch_restarts
    the exit stops the run with one line."""
    cmd = [sys.executable, standin_script(tmp_path, "sglang")]
    eng = build_server_engine(launch_config(tmp_path, "sglang", cmd, launch_restarts=1, weight_sync="tensor"))
    ps, sp = prompts(tokenizer, 2), greedy(tokenizer)
    new = perturbed(model)
    want = answers_of(model, new, ps, sp)
    try:
        eng.update_weights(new, version=1)
        assert_same(eng.generate(ps, sp), want)
        first = eng.launcher
        guard = first.proc.pid
        os.kill([p for p in server_processes(first.server_id) if p != guard][0], signal.SIGKILL)
        first.proc.wait()
        got = eng.generate(ps, sp)
        assert eng.launcher is not first and eng.num_server_restarts == 1 and eng.num_resyncs == 1
        assert_same(got, want)  # the restarted server answered with version 1's weights
        assert all(g.versions == [1] * len(g.token_ids) for g in got)
        assert server_processes(first.server_id) == []
        second = eng.launcher
        os.kill([p for p in server_processes(second.server_id) if p != second.proc.pid][0], signal.SIGKILL)
        second.proc.wait()
        with pytest.raises(EngineError) as err:
            eng.generate(ps, sp)
        assert "\n" not in str(err.value) and "exited with signal 9" in str(err.value)
        assert "restarted 1 times already" in str(err.value)
    finally:
        eng.close()
    assert server_processes(eng.launcher.server_id) == []


def test_managed_launch_exit_is_reported_with_log_tail(tokenizer, tmp_path):
    cmd = [sys.executable, standin_script(tmp_path, "sglang", exit_code=3, message="RuntimeError: no GPU found")]
    with pytest.raises(EngineError) as err:
        build_server_engine(launch_config(tmp_path, "sglang", cmd))
    msg = str(err.value)
    assert "\n" not in msg and "exited with code 3" in msg and "no GPU found" in msg


def test_a_server_that_comes_back_with_other_weights_is_resynced_first(model, tokenizer, tmp_path):
    """One of two servers restarts (its initial weights, weight_version "default"): its answers are
    never returned; it gets version 1 again before it answers; nothing is lost or doubled."""
    a, b = SGLangServer(LocalEngine(model)).start(), SGLangServer(LocalEngine(model)).start()
    ps, sp = prompts(tokenizer, 4), greedy(tokenizer)
    new = perturbed(model)
    want = answers_of(model, new, ps, sp)
    try:
        with make([a.url, b.url], tmp_path) as eng:
            eng.update_weights(new, version=1)
            b.reset_state()  # what a restart leaves behind, without a dropped connection to notice
            assert_same(eng.generate(ps * 2, sp), want * 2)
            assert eng.num_resyncs == 1 and eng.num_stale_answers >= 1 and b.weight_version == "1"
            b.restart(fresh=True)  # and a real restart: the pooled connections break
            assert_same(eng.generate(ps * 2, sp), want * 2)
            assert_same(eng.generate(ps * 2, sp), want * 2)
            assert eng.num_resyncs == 2 and b.weight_version == "1" and eng.version == 1
            late = len(b.calls("/generate"))
            eng.generate(ps * 2, sp)
            assert len(b.calls("/generate")) > late  # back in rotation
    finally:
        a.close()
        b.close()


def test_a_dropped_tensor_bucket_puts_the_server_back_and_tries_again(model, server, tokenizer, tmp_path):
    """A tensor bucket whose answer is lost (the server loaded it; shared-memory handles are never
    sent twice): the half-updated server goes back to the previous weights, then the update runs
    again and completes."""
    ps, sp = prompts(tokenizer, 2), greedy(tokenizer)
    new = perturbed(model, seed=6)
    with make(server.url, tmp_path, weight_sync="tensor", bucket_bytes=1 << 14, model_path=None) as eng:
        eng.update_weights(list(model.state_dict().items()), version=1)
        server.inject("/update_weights_from_tensor", "drop_after", after=2)
        eng.update_weights(new, version=2)
        assert eng.version == 2 and server.weight_version == "2"
        assert_same(eng.generate(ps, sp), answers_of(model, new, ps, sp))


def test_a_server_that_acknowledges_weights_it_did_not_load_stops_the_run(model, server, tokenizer, tmp_path):
    from glmlight.engines.servers.protocol import FleetFailed

    with make(server.url, tmp_path) as eng:
        eng.generate(prompts(tokenizer, 1), greedy(tokenizer))
        eng.update_weights(perturbed(model, seed=1), version=1)
        server.inject("/update_weights_from_disk", "lie")
        with pytest.raises(FleetFailed) as err:
            eng.update_weights(perturbed(model, scale=0.3, seed=2), version=2)
    assert "\n" not in str(err.value) and "did not load the new weights" in str(err.value)


def test_a_server_without_sampling_masks_serves_plain_sampling_and_refuses_top_k(model, ref, tokenizer, tmp_path):
    """SGLang before 0.5.18 cannot report top-k/top-p log-probs: it passes the start-up check (the
    temperature part), serves sampling without top-k/top-p, and a top-k request stops the run."""
    from glmlight.engines.servers.sglang.wire import FilteredLogprobsMissing

    srv = SGLangServer(LocalEngine(model), sampling_mask=False).start()
    try:
        with make(srv.url, tmp_path) as eng:
            ps, sp = prompts(tokenizer, 2), SamplingParams(temperature=0.8, max_new_tokens=5, seed=1)
            assert_same(eng.generate(ps, sp), expected(ref, ps, sp))
            with pytest.raises(FilteredLogprobsMissing, match="0.5.18"):
                eng.generate(ps, SamplingParams(temperature=0.8, top_k=5, max_new_tokens=5, seed=1))
    finally:
        srv.close()


def test_a_server_reporting_log_probs_before_temperature_is_refused(model, tokenizer, tmp_path):
    srv = SGLangServer(LocalEngine(model), original_logprob=True).start()
    try:
        with pytest.raises(EngineError) as err:
            make(srv.url, tmp_path)
    finally:
        srv.close()
    msg = str(err.value)
    assert "\n" not in msg and "before temperature" in msg and "SGLANG_RETURN_ORIGINAL_LOGPROB" in msg


def test_seeds_are_honoured_only_in_deterministic_mode_and_the_run_is_told(model, tokenizer, tmp_path, caplog):
    """SGLang uses sampling_seed only with --enable-deterministic-inference (never on CPU); /server_info
    says whether it is on. Without it the engine reports `seeded_sampling = False` and warns once."""
    ps = prompts(tokenizer, 1)
    sp = SamplingParams(temperature=1.0, max_new_tokens=8, seed=3)
    for deterministic in (True, False):
        srv = SGLangServer(LocalEngine(model), deterministic=deterministic).start()
        try:
            caplog.clear()
            with make(srv.url, tmp_path) as eng:
                runs = {tuple(eng.generate(ps, sp)[0].token_ids) for _ in range(3)}
            assert eng.seeded_sampling is deterministic
            warned = [r.getMessage() for r in caplog.records if "--enable-deterministic-inference" in r.getMessage()]
            if deterministic:
                assert len(runs) == 1 and not warned
            else:
                assert len(runs) > 1 and len(warned) == 1 and "not reproducible" in warned[0]
        finally:
            srv.close()


def test_a_paused_server_is_up_to_the_suspect_probe(server, tmp_path):
    """SGLang's health paths generate a token, which a pause holds (503 after 20 s): the suspect probe
    reads /model_info instead and finds the paused server up, on its weights, at once."""
    with make(server.url, tmp_path) as eng:
        eng.http.run(eng.servers[server.url].pause())
        try:
            health = len(server.calls("/health_generate")) + len(server.calls("/health"))
            eng.suspects.mark_out(server.url)
            eng.sync_suspects()
            assert server.url not in eng.suspects and eng.num_resyncs == 0
            assert len(server.calls("/health_generate")) + len(server.calls("/health")) == health
        finally:
            eng.http.run(eng.servers[server.url].resume())


def test_an_unknown_sampling_key_is_one_line_with_the_servers_message(server, tokenizer, tmp_path):
    from glmlight.engines.servers.http import Rejected

    with make(server.url, tmp_path) as eng:
        with pytest.raises(Rejected) as err:
            eng.http.run(eng.http.request("/generate", {"input_ids": prompts(tokenizer, 1)[0],
                                                        "sampling_params": {"max_new_tokens": 1, "bogus": 1}},
                                          url=server.url, attempts=1))
    msg = str(err.value)
    assert "\n" not in msg and "HTTP 400: unknown field `bogus`" in msg


def test_a_disk_update_whose_flush_is_refused_keeps_the_new_weights(model, tokenizer, tmp_path):
    """As the real SGLang (tests/integration/servers/test_real_servers.py): with a request still running at
    a disk update, the weights load, the flush is refused and the answer is 400 success: false; the client keeps the
    new weights (no roll-back, no second load) and /model_info is brought to the new version."""
    srv = SGLangServer(LocalEngine(model)).start()
    new = perturbed(model)
    ps, sp = prompts(tokenizer, 1), greedy(tokenizer)
    want = answers_of(model, new, ps, sp)
    try:
        with make(srv.url, tmp_path) as eng:
            eng.http.run(eng.servers[srv.url].pause())
            srv.in_flight += 1  # a request the pause did not end (e.g. paused in place)
            loads = len(srv.calls("/update_weights_from_disk"))
            source = eng.sync.push([eng.servers[srv.url]], new, None, 1, eng._current)
            srv.in_flight -= 1
            assert len(srv.calls("/update_weights_from_disk")) == loads + 1 and srv.weight_version == "1"
            assert eng.http.run(eng.servers[srv.url].label()) == "1" and source.version == 1
            eng.http.run(eng.servers[srv.url].resume())
            eng._current, eng._version, eng.suspects.expect[srv.url] = source, 1, "1"
            assert_same(eng.generate(ps, sp), want)
    finally:
        srv.close()
