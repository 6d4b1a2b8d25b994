"""A stand-in for an SGLang 0.5.23 server (native API), backed by the embedded engine. The real server
runs here on CPU (tests/integration/servers/test_real_servers.py); the stand-in stays for what only SGLang on CUDA does
(routed experts, indexer top-k, FP8 serving, seeded sampling) and for injected faults.

Checked against the real 0.5.23 on CPU as well as read from its source:
- top-k with top-p: both filters on the same un-renormalised distribution ("joint", srt/layers/sampler.py
  `top_k_top_p_min_p_sampling_from_probs_torch`): the backing engine samples in that order;
- sampling_seed is used only with --enable-deterministic-inference (`deterministic`, reported in
  /server_info as enable_deterministic_inference); off, the seed is ignored;
- /health and /health_generate generate a token, which a pause holds: 503 after 20 s
  (srt/entrypoints/http_server.py `health_generate`, HEALTH_CHECK_TIMEOUT);
- /generate answers an unknown sampling_params key 400 {"error": "unknown field `<key>`, expected one of
  ..."} (a plain string; `SAMPLING_KEYS`);
- a disk update while requests run loads the weights and moves the scheduler's version (stamped on
  answers), then answers 400 success: false because the flush was refused; /model_info keeps the old
  version until /update_weight_version.
- /abort_request {rid} ends requests at once: finish_reason abort with the tokens so far (checked for the
  exact rid of a request in flight).
- a tensor payload the restricted unpickler refuses kills the server (observed: the scheduler's
  exception is not caught; SGLang then kills its process tree).
Where it still differs from the real server: it does not abort a non-streaming request whose client
disconnected (the real one does, srt/managers/tokenizer_manager.py `_stream_one_response`, after up to
SGLANG_REQUEST_STATE_WAIT_TIMEOUT, 4 s, srt/environ.py); timing (the backing engine's speed, a pause
polling every 10 ms instead of every 1 s).

What it does is read from sglang-0.5.23's source (paths inside the wheel's `sglang/` package):
- /generate (srt/entrypoints/http_server.py:928-990): a rid still held by an earlier request answers
  400 {"error": {"message": "Duplicate request ID detected: <rid>"}} (srt/managers/tokenizer_manager.py
  `_init_req_state`, http_server.py `_create_error_response`); requests sent while paused wait for
  /continue_generation (tokenizer_manager.py:938-939). meta_info has id, finish_reason
  ({"type": "stop", "matched"} | {"type": "length", "length"} | {"type": "abort", "message", ...},
  srt/managers/schedule_batch.py:279-345), prompt_tokens, completion_tokens, cached_tokens,
  weight_version and, finished, weight_versions [{"version", "start", "end"}]
  (srt/utils/weight_versions.py); output_token_logprobs are [logprob, id, null] after temperature and
  before top-k/top-p (srt/layers/sampler.py); with return_sampling_mask, output_token_sampling_logprobs
  are the renormalised ones, refused with 400 unless top_k == 1 or 1 < top_k <= 4096
  (srt/managers/scheduler.py:3160-3182); input_token_logprobs from logprob_start_len with entry 0 None.
- /abort_request {rid, abort_all} (http_server.py `abort_request`, 1721-1731) answers 200 at once and
  ends the requests in the background: the HTTP process ignores an empty rid without abort_all, and
  forwards a rid only when it holds a request with exactly that rid, once per request
  (tokenizer_manager.py `abort_request`, 2241-2263); the scheduler then ends every request it has whose
  rid starts with the given one, or all of them with abort_all (scheduler.py `abort_request`,
  5675-5812): a running one answers with its tokens so far and finish_reason {"type": "abort",
  "message": "Aborted", "status_code": null, "err_type": null} (schedule_batch.py `FINISH_ABORT`), a
  queued one with none and {"type": "abort", "message": "Abort in waiting queue"}
  (tokenizer_manager.py `_handle_abort_req`, 3577-3643). A request still waiting for
  /continue_generation has not reached the scheduler, so an abort misses it.
- /update_weight_version aborts every request first unless abort_all_requests is false (its default is
  true; http_server.py `update_weight_version`, srt/managers/io_struct.py `UpdateWeightVersionReqInput`).
- The model-update lock (srt/utils/aio_rwlock.py `RWLock`, tokenizer_manager.py:771): a request holds it
  shared from the moment it passes the pause gate until it has answered (tokenizer_manager.py
  `generate_request`, 938-941). /update_weights_from_disk (tokenizer_manager.py
  `update_weights_from_disk`, 2288-2323), /update_weights_from_tensor, /update_weights_from_distributed,
  /begin_weight_update and /end_weight_update (srt/managers/tokenizer_control_mixin.py
  `update_weights_from_tensor`, `update_weights_from_distributed`, `_weight_update_session_call`,
  471-597) first abort every request if abort_all_requests (default false), then, unless the server is
  paused, take it exclusively: they wait for the requests in flight to finish, and requests sent
  meanwhile wait behind them (a waiting writer goes first). Paused, they run at once (all but the disk
  update holding the pause lock, so /continue_generation waits for them).
- /pause_generation {mode: abort} aborts every request and returns once the model-update lock is free,
  i.e. every request has answered (tokenizer_manager.py `pause_generation`, 2267-2280);
  /continue_generation; /flush_cache answers 400 "Flush cache failed." while requests run
  (scheduler.py:5518-5547).
- /begin_weight_update and /end_weight_update open and close a weight-update session
  (srt/managers/scheduler_components/weight_updater.py:309-335); /update_weights_from_tensor and
  /update_weights_from_distributed answer 400 {"success": false, "message": "<name> must run between
  begin_weight_update() and end_weight_update()"} without one (same file, 192-197 and 234-239);
  /update_weights_from_disk is not gated.
- /update_weights_from_tensor decodes each payload with SGLang's restricted unpickler
  (`SafeUnpickler`, srt/utils/common.py:3144-3370: an allow-list of globals) in another process
  started on its own, as SGLang's scheduler is, so shared-memory handles that only the sender's
  processes can open fail here as they fail there. A payload that is not base64 is refused by the HTTP
  process's request validation: 400 {"object": "error", "message", "type": "Bad Request", "code": 400}
  (srt/utils/msgspec_utils.py `Base64Bytes`, http_server.py `validation_exception_handler`). A payload
  that fails to unpickle kills the server: the scheduler deserialises it outside any try
  (weight_updater.py `update_weights_from_tensor`, 232-245; srt/managers/tp_worker.py
  `deserialize_own_rank`), its process logs "Scheduler hit an exception" and sends SIGQUIT to the
  server's main process (scheduler.py `run_scheduler_process`, 6370-6373), which kills its children and
  then itself with SIGKILL (tokenizer_manager.py `SignalHandler.running_phase_sigquit_handler`,
  4072-4081; srt/utils/common.py `kill_process_tree`, 2507-2564). The update gets no answer (its
  connection drops), nor does any other request in flight, and nothing listens on the port any more.
  Here the decoder process dies of the exception and the server calls `on_death`: in a process of its
  own (`serve_main`) that kills its children and then itself with SIGKILL, as SGLang does; in the test
  process it stops serving (every connection closed, the port refused) and stays down (`dead`).
- No /get_weight_version (removed); /model_info (and the deprecated /get_model_info) carry
  weight_version, "default" at start (http_server.py:802-848); /server_info and /get_server_info
  carry tp_size; /update_weight_version; /init_weights_update_group (gloo only here) and
  /destroy_weights_update_group.
- Replay records (`routed_experts=True`: started with --enable-return-routed-experts; `indexer_topk=True`:
  --enable-return-indexer-topk; srt/arg_groups/fields/exec_.py:158-164): a request with
  return_routed_experts gets meta_info.routed_experts, base64 int32 [len(prompt) + len(output) - 1 -
  routed_experts_start_len, num_hidden_layers, k], dense layers 0 (srt/managers/detokenizer_manager.py:431-447,
  srt/managers/scheduler_components/batch_result_processor.py:136-179, srt/state_capturer/base.py:38-75,
  173-188); a start_len outside [0, len(prompt)] answers 400 (srt/managers/scheduler.py:3300-3319). With
  return_indexer_topk, meta_info.indexer_topk, int32 [n - 1, num_hidden_layers, index_topk] from position 0
  (batch_result_processor.py:181-189): positions -1 padded with `fuse_topk=False` (SGLANG_DSA_FUSE_TOPK=0),
  else KV-cache slot ids, here position + SLOT_BASE (srt/layers/attention/dsa/dsa_topk_backend.py:23-27,
  109-110, 272-309; srt/environ.py:1978). A server started without the flag omits the field
  (srt/state_capturer/routed_experts.py:50-51). Built with glmlight's `*_payload` encoders.
`original_logprob=True` behaves as a server started with SGLANG_RETURN_ORIGINAL_LOGPROB=1 (log-probs
before temperature, srt/layers/sampler.py:82, 231-237). Faults beyond the base's: "lie" on an update path acknowledges the version without loading it;
"slow" on /generate holds the request (its rid registered) before answering.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np
from aiohttp import web

from glmlight.engines.local.engine import LocalEngine
from glmlight.engines.servers.replay_codec import RecordLayout, sglang_indexer_topk_payload, sglang_routed_experts_payload
from glmlight.engines.transport import decode_safetensors
from tests.support.standin_base import FAULT, ProtocolServer, _params, join_gloo_group, receive

SESSION_MESSAGE = "{} must run between begin_weight_update() and end_weight_update()"
# sampling_params keys /generate accepts (0.5.23 answers any other key 400 {"error": "unknown field `<key>`,
# expected one of ..."}, observed on the real server; the list is the one it names)
SAMPLING_KEYS = ("max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
                 "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "json_schema",
                 "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens",
                 "spaces_between_special_tokens", "no_stop_trim", "stream_interval", "logit_bias", "sampling_seed",
                 "custom_params", "beam_width", "watermark", "choice")
SLOT_BASE = 4096  # where the stand-in's KV-cache slots start (the fused DSA top-k reports slots)

# SGLang 0.5.23 SafeUnpickler.ALLOWED_GLOBALS (srt/utils/common.py:3148-3359), the part a tensor
# payload can use; everything else raises "Blocked unsafe global".
DECODER = r'''
import base64, io, pickle, sys
import torch, torch.multiprocessing
from safetensors.torch import save
ALLOWED = {("builtins", n) for n in ("bool", "bytearray", "bytes", "complex", "dict", "float", "frozenset", "int",
                                     "list", "range", "set", "slice", "str", "tuple")}
ALLOWED |= {("collections", "OrderedDict"), ("copyreg", "__newobj__"), ("copyreg", "__newobj_ex__"),
            ("multiprocessing.reduction", "_rebuild_partial"), ("multiprocessing.resource_sharer", "DupFd"),
            ("torch", "Size"), ("torch", "device"), ("torch", "dtype"), ("torch", "Tensor"), ("torch", "UntypedStorage"),
            ("torch.storage", "UntypedStorage"), ("torch.storage", "TypedStorage"), ("torch._tensor", "_rebuild_from_type_v2"),
            ("torch.nn.parameter", "Parameter")}
ALLOWED |= {("torch._utils", n) for n in ("_rebuild_tensor", "_rebuild_tensor_v2", "_rebuild_tensor_v3", "_rebuild_parameter",
                                          "_rebuild_parameter_with_state")}
ALLOWED |= {("torch.multiprocessing.reductions", n) for n in (
    "rebuild_tensor", "rebuild_cuda_tensor", "rebuild_storage_fd", "rebuild_storage_filename", "rebuild_storage_empty",
    "rebuild_typed_storage", "rebuild_typed_storage_child", "rebuild_meta_tensor")}
ALLOWED |= {("sglang.srt.utils.patch_torch", "_rebuild_cuda_tensor_modified")}
class SafeUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if (module, name) in ALLOWED or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)) \
                or (module in ("torch", "torch.cuda") and name.endswith("Storage")):
            return super().find_class(module, name)
        raise RuntimeError(f"Blocked unsafe global ({module}.{name}) during pickle deserialization")
for line in sys.stdin:
    try:
        named = SafeUnpickler(io.BytesIO(base64.b64decode(line.strip(), validate=True))).load()
    except Exception:  # uncaught in SGLang's scheduler: it dies of it
        import traceback
        print("Scheduler hit an exception: " + traceback.format_exc(), file=sys.stderr, flush=True)
        sys.exit(1)
    print("OK " + base64.b64encode(save({n: t.contiguous() for n, t in named})).decode(), flush=True)
'''


class ModelUpdateLock:
    """SGLang's model-update lock (srt/utils/aio_rwlock.py `RWLock`): shared by requests, exclusive for
    weight updates sent while not paused; a writer that waits goes before readers that come after it."""

    def __init__(self) -> None:
        self._cond = asyncio.Condition()
        self.readers, self.writer, self.waiting_writers = 0, False, 0

    @contextlib.asynccontextmanager
    async def shared(self):
        async with self._cond:
            await self._cond.wait_for(lambda: not self.writer and self.waiting_writers == 0)
            self.readers += 1
        try:
            yield
        finally:
            async with self._cond:
                self.readers -= 1
                self._cond.notify_all()

    @contextlib.asynccontextmanager
    async def exclusive(self):
        async with self._cond:
            self.waiting_writers += 1
            try:
                await self._cond.wait_for(lambda: not self.writer and self.readers == 0)
                self.writer = True
            finally:
                self.waiting_writers -= 1
                self._cond.notify_all()
        try:
            yield
        finally:
            async with self._cond:
                self.writer = False
                self._cond.notify_all()

    def locked(self) -> bool:
        return self.writer or self.readers > 0


class SGLangServer(ProtocolServer):
    open_paths = ("/health", "/health_generate")  # SGLang's key middleware lets health checks through

    def __init__(self, engine: LocalEngine, *, sampling_mask: bool = True, original_logprob: bool = False,
                 routed_experts: bool = False, indexer_topk: bool = False, fuse_topk: bool = True,
                 deterministic: bool = True, **kw: Any):
        super().__init__(engine, **kw)
        # SGLang samples with top-k and top-p over the same un-renormalised distribution ("joint")
        engine.filter_order = engine._batch.filter_order = "joint"
        # --enable-deterministic-inference: only then are per-request sampling seeds used (CUDA only;
        # off, as on every CPU server, the seed is ignored)
        self.deterministic = deterministic
        self.routed_experts, self.indexer_topk, self.fuse_topk = routed_experts, indexer_topk, fuse_topk
        self.layout = RecordLayout.from_model(engine.model)
        if routed_experts or indexer_topk:
            engine.capture_replay(routing=routed_experts, index=indexer_topk)
        self.original_logprob = original_logprob  # SGLANG_RETURN_ORIGINAL_LOGPROB=1: before temperature
        self.sampling_mask = sampling_mask  # False: a release before 0.5.18 (the field is ignored)
        self.weight_version = "default"  # the scheduler's: stamped on answers
        self.info_version: str | None = None  # /model_info's when it lags the scheduler's (a refused flush)
        self.health_timeout_s = 20.0
        self.version_lag_s = 0.0  # report a new weight_version only this long after an update
        self.running = threading.Event()
        self.running.set()
        self.groups: dict[str, Any] = {}
        self.session_open = False
        self.held: set[str] = set()  # rids registered (in flight or waiting)
        self.abort_sent: set[str] = set()  # held rids an /abort_request was forwarded for
        self.live: dict[str, Any] = {}  # rid -> the engine future of a request the "scheduler" has
        self.in_flight = 0
        self.update_lock = ModelUpdateLock()
        self.pause_lock = asyncio.Lock()  # SGLang's is_pause_cond
        self.dead = False  # the server died (an unloadable tensor payload); `on_death` took it down
        self.on_death: Callable[[], None] = self._stop_serving
        self._decoder: subprocess.Popen | None = None
        self._decoder_lock = threading.Lock()

    def reset_state(self) -> None:
        super().reset_state()
        self.weight_version, self.info_version, self.session_open = "default", None, False
        self.groups.clear()
        self.held.clear()
        self.abort_sent.clear()
        self.running.set()

    def _stop_serving(self) -> None:
        """A death in the test process: every connection closed, the port refused from now on."""
        self._kill_decoder()
        threading.Thread(target=self.stop, daemon=True).start()

    def _kill_decoder(self) -> None:
        if self._decoder is not None and self._decoder.poll() is None:
            self._decoder.kill()
            self._decoder.wait()

    def close(self) -> None:
        super().close()
        self._kill_decoder()

    def start(self) -> SGLangServer:
        if self.dead:
            raise RuntimeError("the server died; start another")
        super().start()
        return self

    def routes(self, app: web.Application) -> None:
        r = app.router
        for path in ("/health", "/health_generate"):
            r.add_get(path, self.health)
        for path in ("/model_info", "/get_model_info"):
            r.add_get(path, self.model_info)
        for path in ("/server_info", "/get_server_info"):
            r.add_get(path, lambda req: web.json_response({"tp_size": 1, "dp_size": 1, "version": "0.5.23",
                                                           "enable_deterministic_inference": self.deterministic}))
        r.add_route("*", "/generate", self.generate)
        r.add_route("*", "/flush_cache", self.flush)
        r.add_post("/pause_generation", self.pause)
        r.add_post("/continue_generation", self.cont)
        r.add_post("/abort_request", self.abort_request)
        r.add_post("/begin_weight_update", self.begin)
        r.add_post("/end_weight_update", self.end)
        r.add_post("/update_weights_from_disk", self.from_disk)
        r.add_post("/update_weights_from_tensor", self.from_tensor)
        r.add_post("/init_weights_update_group", self.init_group)
        r.add_post("/destroy_weights_update_group", self.destroy_group)
        r.add_post("/update_weights_from_distributed", self.from_distributed)
        r.add_post("/update_weight_version", self.set_version)

    async def health(self, request: web.Request) -> web.Response:
        """Both paths run a one-token generation, which a paused server holds: 503 after
        HEALTH_CHECK_TIMEOUT (20 s; srt/entrypoints/http_server.py `health_generate`)."""
        for _ in range(int(self.health_timeout_s / 0.05)):
            if self.running.is_set():
                return web.Response(status=200)
            await asyncio.sleep(0.05)
        return web.Response(status=503)

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response({
            "model_path": "stand-in", "served_model_name": "stand-in", "tokenizer_path": "stand-in",
            "is_generation": True, "preferred_sampling_params": None,
            "weight_version": self.info_version if self.info_version is not None else self.weight_version,
            "load_format": "auto", "reasoning_parser": None, "tool_call_parser": None, "disaggregation_mode": "null",
            "has_image_understanding": False, "has_audio_understanding": False, "model_type": "glm_moe_dsa",
            "architectures": ["GlmMoeDsaForCausalLM"]})

    # ------------------------------------------------------------------ generation
    async def generate(self, request: web.Request) -> web.Response:
        body = await request.json()
        rid = body.get("rid") or uuid.uuid4().hex
        if rid in self.held:
            return web.json_response({"error": {"message": f"Duplicate request ID detected: {rid}"}}, status=400)
        self.held.add(rid)
        try:
            fault = request.get(FAULT)
            if fault is not None and fault.kind == "slow":  # a slow request that is registered meanwhile
                await asyncio.sleep(fault.seconds)
            await self.run_engine(self.running.wait)  # held while paused, as SGLang holds new requests
            async with self.update_lock.shared():  # until answered: an update not sent while paused waits
                return await self._generate(body, rid)
        finally:
            self.held.discard(rid)
            self.abort_sent.discard(rid)

    async def _generate(self, body: dict, rid: str) -> web.Response:
        ids, sp = body["input_ids"], dict(body.get("sampling_params") or {})
        unknown = [k for k in sp if k not in SAMPLING_KEYS]
        if unknown:
            return web.json_response({"error": f"unknown field `{unknown[0]}`, expected one of "
                                               + ", ".join(f"`{k}`" for k in SAMPLING_KEYS)}, status=400)
        if not self.deterministic:
            sp.pop("sampling_seed", None)
        max_new = int(sp.get("max_new_tokens", 128))
        temperature, top_k = float(sp.get("temperature", 1.0)), int(sp.get("top_k", -1))
        mask = self.sampling_mask and body.get("return_sampling_mask")
        if mask and top_k != 1 and not (1 < top_k <= 4096):
            return web.json_response({"error": {"message": "return_sampling_mask requires top_k=1 for greedy sampling "
                                                           f"or finite 1 < top_k <= 4096; got top_k={top_k}."}}, status=400)
        start_len = int(body.get("routed_experts_start_len") or 0)
        if body.get("return_routed_experts") and not 0 <= start_len <= len(ids):
            return web.json_response({"error": {"message": f"routed_experts_start_len ({start_len}) must be between 0 "
                                                           f"and the prompt length ({len(ids)})"}}, status=400)
        meta: dict[str, Any] = {"id": rid, "prompt_tokens": len(ids), "cached_tokens": 0}
        out_ids: list[int] = []
        meta["output_token_logprobs"], meta["finish_reason"] = [], {"type": "length", "length": 0}
        if max_new > 0:
            self.in_flight += 1
            future = self.live[rid] = self.engine.submit(ids, _params(sp, max_new))  # what /abort_request ends
            try:
                gen = await asyncio.wrap_future(future)
            finally:
                self.live.pop(rid, None)
                self.in_flight -= 1
            self.answers[rid].append(gen)
            out_ids = gen.token_ids
            unfiltered = list(gen.logprobs)  # without top-k/top-p the sampling distribution is the unfiltered one
            filtered = temperature > 0 and (top_k > 0 or float(sp.get("top_p", 1.0)) < 1)
            if (filtered or (self.original_logprob and temperature > 0)) and out_ids:
                t = 1.0 if self.original_logprob else temperature  # after temperature, before top-k/top-p
                unfiltered = (await self.run_engine(self.engine.score, [ids], [out_ids], t))[0]
            meta["output_token_logprobs"] = [[lp, tok, None] for lp, tok in zip(unfiltered, out_ids)]
            if mask:
                meta["output_token_sampling_logprobs"] = list(gen.logprobs)
                meta["output_token_sampling_mask"] = [[tok] for tok in out_ids]
            self._records(meta, body, gen, len(ids) + len(out_ids), start_len)
            meta["finish_reason"] = {"stop": {"type": "stop", "matched": out_ids[-1] if out_ids else None},
                                     "length": {"type": "length", "length": len(out_ids)},
                                     "abort": {"type": "abort", "message": "Aborted", "status_code": None,
                                               "err_type": None} if out_ids else
                                     {"type": "abort", "message": "Abort in waiting queue"}
                                     }.get(gen.finish_reason, {"type": "length"})
        meta["weight_version"] = self.weight_version
        meta["weight_versions"] = [{"version": self.weight_version, "start": 0, "end": len(out_ids)}]
        start = body.get("logprob_start_len")
        if body.get("return_logprob") and start is not None and start >= 0:
            # entry 0 is always None; entry i is log p(ids[start + i] | ids[:start + i])
            lps = (await self.run_engine(self.engine.score, [ids[: start + 1]], [ids[start + 1:]]))[0]
            self.scores[rid].append(lps)
            meta["input_token_logprobs"] = [[None, ids[start], None]] + [[lp, t, None] for lp, t in zip(lps, ids[start + 1:])]
        meta["completion_tokens"] = len(out_ids)
        return web.json_response({"text": "", "output_ids": out_ids, "meta_info": meta})

    def _records(self, meta: dict, body: dict, gen: Any, num_tokens: int, start_len: int) -> None:
        """meta_info.routed_experts / .indexer_topk as SGLang sends them (module docstring)."""
        if self.routed_experts and body.get("return_routed_experts") and gen.routed_experts is not None:
            meta["routed_experts"] = sglang_routed_experts_payload(gen.routed_experts[start_len:], self.layout)
        if self.indexer_topk and body.get("return_indexer_topk") and gen.indexer_topk is not None:
            payload = sglang_indexer_topk_payload(gen.indexer_topk, num_tokens, self.layout)
            if self.fuse_topk:  # KV-cache slot ids instead of positions
                arr = np.frombuffer(base64.b64decode(payload), dtype=np.int32)
                payload = base64.b64encode(np.where(arr >= 0, arr + SLOT_BASE, arr).astype(np.int32).tobytes()).decode()
            meta["indexer_topk"] = payload

    async def pause(self, request: web.Request) -> web.Response:
        mode = ((await request.json()) or {}).get("mode", "abort") if await request.read() else "abort"
        async with self.pause_lock:
            self.running.clear()
            if mode == "abort":  # returns once every request has answered (the model-update lock is free)
                while self.update_lock.locked():
                    await self.run_engine(self.engine.abort_all, control=True)
                    await asyncio.sleep(0.01)
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def cont(self, request: web.Request) -> web.Response:
        async with self.pause_lock:
            self.running.set()
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def flush(self, request: web.Request) -> web.Response:
        if self.in_flight > 0:
            return web.Response(text="Flush cache failed.\n", status=400)
        return web.Response(text="Cache flushed.\nPlease check backend logs for more details. (When there are running "
                                 "or waiting requests, the operation will not be performed.)\n")

    async def abort_request(self, request: web.Request) -> web.Response:
        body = ((await request.json()) or {}) if await request.read() else {}
        rid, abort_all = str(body.get("rid") or ""), bool(body.get("abort_all"))
        if not abort_all:  # the HTTP process forwards only a rid it holds, once
            if not rid or rid not in self.held or rid in self.abort_sent:
                return web.Response(status=200)
            self.abort_sent.add(rid)
        self._abort(rid, abort_all)
        return web.Response(status=200)

    def _abort(self, rid: str = "", abort_all: bool = False) -> None:
        """The scheduler's side of an abort, in the background (the caller does not wait): every request
        it has whose rid starts with `rid`, or all of them."""
        futures = [f for r, f in self.live.items() if abort_all or r.startswith(rid)]
        if abort_all:
            self._loop.run_in_executor(self._ctl_pool, self.engine.abort_all)
        elif futures:
            self._loop.run_in_executor(self._ctl_pool, self.engine.abort, futures)

    # ------------------------------------------------------------------ weight updates
    @contextlib.asynccontextmanager
    async def _update_turn(self, body: dict, holds_pause: bool = True):
        """How SGLang's HTTP process runs an update or a session call (module docstring): abort every
        request if asked, then, paused, at once (holding the pause lock unless `holds_pause` is false: the
        disk update only reads it); else under the exclusive model-update lock."""
        if body.get("abort_all_requests"):
            self._abort(abort_all=True)
        await self.pause_lock.acquire()
        paused = not self.running.is_set()
        if paused and holds_pause:
            try:
                yield
            finally:
                self.pause_lock.release()
            return
        self.pause_lock.release()
        async with contextlib.nullcontext() if paused else self.update_lock.exclusive():
            yield

    async def begin(self, request: web.Request) -> web.Response:
        async with self._update_turn({}):
            if self.session_open:
                return _fail("a weight-update session is already open; call end_weight_update() first")
            self.session_open = True
            return web.json_response({"success": True, "message": "Weight-update session opened."})

    async def end(self, request: web.Request) -> web.Response:
        async with self._update_turn({}):
            if not self.session_open:
                return _fail("no weight-update session is open; call begin_weight_update() first")
            self.session_open = False
            return web.json_response({"success": True, "message": "Weight-update session closed."})

    async def _update(self, request: web.Request, body: dict, named: Any = None, path: str | None = None) -> web.Response:
        fault = request.get(FAULT)
        if fault is None or fault.kind != "lie":
            kw = {"path": path} if path is not None else {"named_tensors": named}
            try:
                await self.run_engine(lambda: self.engine.update_weights(**kw, version=self.engine.version), control=True)
            except Exception as e:  # noqa: BLE001 - reported like SGLang reports a failed load
                return _fail(f"Failed to update weights: {e}")
        if path is not None and body.get("flush_cache", True) and self.in_flight > 0:
            # the weights and the scheduler's version moved, the flush is refused, /model_info keeps the old
            # version (srt/managers/scheduler_components/weight_updater.py `flush_cache_after_weight_update`)
            self.info_version = self.weight_version
            self.weight_version = body.get("weight_version") or self.weight_version
            return _fail("Weights were updated, but the cache was not flushed because requests are still running "
                         "or queued. Retract or finish them, then call /flush_cache.")
        self.info_version = None
        if body.get("weight_version") is not None:
            new = body["weight_version"]
            if self.version_lag_s > 0:
                threading.Timer(self.version_lag_s, lambda: setattr(self, "weight_version", new)).start()
            else:
                self.weight_version = new
        return web.json_response({"success": True, "message": f"Succeeded to update model weights. Weight version "
                                                              f"updated to {body.get('weight_version')}.",
                                  "num_paused_requests": 0})

    async def from_disk(self, request: web.Request) -> web.Response:
        body = await request.json()
        async with self._update_turn(body, holds_pause=False):
            return await self._update(request, body, path=body.get("model_path"))

    async def from_tensor(self, request: web.Request) -> web.Response:
        body = await request.json()
        payloads = body.get("serialized_named_tensors")
        try:  # the HTTP process's request validation (Base64Bytes)
            for p in payloads:
                base64.b64decode(p, validate=True)
        except (binascii.Error, TypeError, ValueError):
            return web.json_response({"object": "error", "message": "1 validation error: serialized_named_tensors: "
                                      "Value error, Expected base64-encoded bytes", "type": "Bad Request",
                                      "param": None, "code": 400}, status=400)
        async with self._update_turn(body):
            if not self.session_open:
                return _fail(SESSION_MESSAGE.format("update_weights_from_tensor"))
            reply = await self.run_engine(self._decode, payloads[0], control=True)  # TP rank 0
            if reply is None:  # the "scheduler" died of the payload
                return self._die(request)
            return await self._update(request, body, named=decode_safetensors(reply[3:]))

    def _decode(self, payload: str) -> str | None:
        """One payload through the restricted unpickler, in the decoder process (started once): "OK
        <safetensors, base64>", or None when it died of the payload."""
        with self._decoder_lock:
            if self._decoder is None or self._decoder.poll() is not None:
                self._decoder = subprocess.Popen([sys.executable, "-c", DECODER], stdin=subprocess.PIPE,
                                                 stdout=subprocess.PIPE, text=True, bufsize=1)
            assert self._decoder.stdin is not None and self._decoder.stdout is not None
            try:
                self._decoder.stdin.write(payload + "\n")
                self._decoder.stdin.flush()
            except OSError:
                return None
            return self._decoder.stdout.readline().strip() or None

    def _die(self, request: web.Request) -> web.Response:
        """SGLang's main process on its scheduler's SIGQUIT: the whole server goes (module docstring); the
        call that killed it gets no answer."""
        print("SIGQUIT received. It usually means one child failed.", file=sys.stderr, flush=True)
        self.dead = True
        request.transport.close()  # type: ignore[union-attr]
        self.on_death()
        return web.Response(status=500)

    async def init_group(self, request: web.Request) -> web.Response:
        b = await request.json()
        if b.get("backend") != "gloo":
            return _fail("the stand-in speaks gloo only")
        self.groups[b["group_name"]] = await self.run_engine(
            join_gloo_group, b["master_address"], int(b["master_port"]), int(b["world_size"]), int(b["rank_offset"]),
            b["group_name"], control=True)
        return web.json_response({"success": True, "message": "Succeeded to initialize custom process group."})

    async def destroy_group(self, request: web.Request) -> web.Response:
        self.groups.pop((await request.json()).get("group_name", "weight_update_group"), None)
        return web.json_response({"success": True, "message": "Succeeded to destroy custom process group."})

    async def from_distributed(self, request: web.Request) -> web.Response:
        b = await request.json()
        async with self._update_turn(b):
            if not self.session_open:  # refused before receiving anything: the sender's broadcast waits in vain
                return _fail(SESSION_MESSAGE.format("update_weights_from_distributed"))
            group = self.groups.get(b.get("group_name", "weight_update_group"))
            if group is None:
                return _fail("the process group was not initialized")
            named = await self.run_engine(receive, group, b["names"], b["dtypes"], b["shapes"], control=True)
            return await self._update(request, b, named=named)

    async def set_version(self, request: web.Request) -> web.Response:
        body = await request.json()
        if body.get("abort_all_requests", True):
            self._abort(abort_all=True)
        self.weight_version, self.info_version = body["new_version"], None
        return web.json_response({"success": True, "message": f"Weight version updated to {body['new_version']}",
                                  "new_version": body["new_version"]})


def _fail(message: str) -> web.Response:
    return web.json_response({"success": False, "message": message}, status=400)



