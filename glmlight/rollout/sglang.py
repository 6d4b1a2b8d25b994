"""SGLangEngine: the RolloutEngine protocol over SGLang's native HTTP API (0.5.x).

Generation: POST /generate {rid, input_ids, sampling_params, return_logprob: true}; ids
and log-probs come from meta_info.output_token_logprobs ([[logprob, token_id, text], ...]),
the finish reason from meta_info.finish_reason.type, the weights' version from
meta_info.weight_version. SGLang's log-probs are those of the temperature-scaled
distribution before top-k/top-p filtering (the embedded engine's are after filtering;
the two agree when top_p = 1 and top_k = 0).

Prefill scoring (teacher log-probs): /generate with max_new_tokens 0, return_logprob and
logprob_start_len = len(prompt) - 1. SGLang's input_token_logprobs are aligned with
input_ids[logprob_start_len:] and its entry 0 is always None (the server pads it), so
entry 0 is the prompt's last token and entries 1.. are the completion's.

Weight sync (`weight_sync`), each wrapped as /pause_generation (mode abort: in-flight
requests return early with finish_reason abort, so no answer mixes two versions) →
update → /flush_cache → /continue_generation, then /model_info is polled until
weight_version equals the new version:
- disk: a safetensors checkpoint in HF layout, written atomically to
  weight_sync_dir/v{version}/, then /update_weights_from_disk {model_path, weight_version};
- tensor: /update_weights_from_tensor with serialized_named_tensors = one entry per TP
  rank, each base64(ForkingPickler(list of (name, tensor))) like SGLang's
  MultiprocessingSerializer: CUDA tensors travel as IPC handles, CPU tensors as shared
  memory, so trainer and server must share the host (and, for CUDA, the device);
- distributed: /init_weights_update_group once (trainer = rank 0, each server's TP
  ranks from rank_offset), then per bucket /update_weights_from_distributed
  {names, dtypes, shapes, group_name} while this process broadcasts the tensors
  (nccl on CUDA, hccl on Ascend).
"""

from __future__ import annotations

import asyncio
import base64
import io
import os
import sys
import uuid
from collections.abc import Sequence
from typing import Any

import torch

from glmlight.dtypes import dtype_name
from glmlight.errors import EngineError
from glmlight.rollout import transport as wt
from glmlight.rollout.base import SERVER_FINISH_REASONS, Generation, SamplingParams
from glmlight.rollout.http import Rejected, get_field
from glmlight.rollout.launch import LaunchSpec, free_port, launch_target, local_ip_towards, log_path_for
from glmlight.rollout.servers import ServerEngineBase, sampling_fields, server_settings



class SGLangEngine(ServerEngineBase):
    name = "SGLang"
    health_path = "/health_generate"

    def __init__(self, urls: Sequence[str] = (), *, weight_sync: str = "disk",
                 weight_sync_dir: str = ".cache/glmlight/weights", model_path: str | None = None,
                 sync_backend: str = "nccl", sync_master_address: str | None = None,
                 bucket_bytes: int = 1 << 30, keep_checkpoints: int = 2, **kwargs: Any):
        self.weight_sync = weight_sync
        self.weight_sync_dir = weight_sync_dir
        self.model_path = model_path
        self.sync_backend = sync_backend
        self.sync_master_address = sync_master_address
        self.bucket_bytes = bucket_bytes
        self.keep_checkpoints = keep_checkpoints
        self._group: Any = None
        self._group_name = f"glmlight-{uuid.uuid4().hex[:12]}"
        self._tp_sizes: dict[str, int] = {}
        super().__init__(urls, **kwargs)

    @classmethod
    def from_config(cls, cfg: Any) -> SGLangEngine:
        s, kw = cfg.rollout.server, server_settings(cfg)
        launch = None
        if s.launch:
            host, port = launch_target(s.urls)
            key = kw["http"].api_key_env and os.environ.get(kw["http"].api_key_env)
            base = list(s.launch_command or [sys.executable, "-m", "sglang.launch_server"])
            cmd = base + ["--model-path", kw["model_path"], "--host", host, "--port", str(port)]
            cmd += (["--api-key", key] if key else []) + list(s.launch_args)
            launch = LaunchSpec("SGLang", cmd, host, port, log_path_for(cfg, "sglang", port),
                                secrets=(key,) if key else ())
        return cls(launch=launch, sync_backend=s.sync_backend or "nccl",
                   sync_master_address=s.sync_master_address, **kw)

    def _after_ready(self) -> None:
        # Health checks pass without a key; an authenticated call finds a refused key now.
        for url in self.control_urls() if (not self.router or len(self.urls) > 1) else self.urls[:1]:
            self.http.run(self._served_version(url))

    # ------------------------------------------------------------------ generation
    async def _generate_one(self, rid: str, prompt: list[int], p: SamplingParams, version: int) -> Generation:
        sp = {**sampling_fields(p), "max_new_tokens": p.max_new_tokens, "no_stop_trim": True}
        if p.seed is not None:
            sp["sampling_seed"] = p.seed
        payload = {"rid": rid, "input_ids": prompt, "sampling_params": sp, "return_logprob": True, "stream": False}
        url, body = await self.http.request("/generate", payload, pool=self.pool, rid=rid, with_url=True,
                                            on_retry=self._aborter(rid))
        return self._parse_generation(_single(body), url, rid, version)

    def _parse_generation(self, body: Any, url: str, rid: str, version: int) -> Generation:
        path = "/generate"
        meta = get_field(body, "meta_info", url, path, self.name, dict)
        if meta.get("id") not in (None, rid):
            raise EngineError(f"SGLang server at {url} answered request {rid} with meta_info.id {meta['id']!r}")
        ids, lps = _pairs(get_field(body, "meta_info.output_token_logprobs", url, path, self.name, list), url, path,
                          "meta_info.output_token_logprobs")
        out_ids = body.get("output_ids")
        if out_ids is not None and list(out_ids) != ids:
            raise EngineError(f"SGLang server at {url} answered {path} with output_ids that differ from "
                              "meta_info.output_token_logprobs")
        fin = get_field(body, "meta_info.finish_reason", url, path, self.name, (dict, str))
        kind = fin.get("type") if isinstance(fin, dict) else fin
        if kind not in SERVER_FINISH_REASONS:
            raise EngineError(f"SGLang server at {url} answered {path} with unknown meta_info.finish_reason {kind!r}")
        served = _as_int(meta.get("weight_version"), version)
        return Generation(token_ids=ids, logprobs=lps, finish_reason=kind, versions=[served] * len(ids))

    async def _score_one(self, rid: str, prompt: list[int], completion: list[int]) -> list[float]:
        if not completion:
            return []
        payload = {"rid": rid, "input_ids": prompt + completion, "return_logprob": True,
                   "logprob_start_len": len(prompt) - 1, "stream": False,
                   "sampling_params": {"max_new_tokens": 0, "temperature": 1.0, "skip_special_tokens": False}}
        url, body = await self.http.request("/generate", payload, pool=self.pool, rid=rid, with_url=True,
                                            on_retry=self._aborter(rid))
        field = "meta_info.input_token_logprobs"
        entries = get_field(_single(body), field, url, "/generate", self.name, list)
        if len(entries) != len(completion) + 1:
            raise EngineError(f"SGLang server at {url} answered /generate with {len(entries)} {field} entries, "
                              f"expected {len(completion) + 1} (logprob_start_len = len(prompt) - 1)")
        ids, lps = _pairs(entries[1:], url, "/generate", field)
        if ids != completion:
            raise EngineError(f"SGLang server at {url} answered /generate with {field} for other tokens than sent")
        return lps

    def _aborter(self, rid: str):
        async def abort(url: str, reason: str) -> None:
            """Before a retry after a timeout, drop the first attempt on the server (best effort)."""
            if reason.startswith("no answer"):
                try:
                    await self.http.request("/abort_request", {"rid": rid}, url=url, attempts=1, timeout_s=5,
                                            expect_json=False, allow_404=True)
                except EngineError:
                    pass
        return abort

    # ------------------------------------------------------------------ weight sync
    async def _pause(self, url: str) -> None:
        await self.http.request("/pause_generation", {"mode": "abort"}, url=url, expect_json=False, allow_404=True)

    async def _flush(self, url: str) -> None:
        # /flush_cache answers 400 while requests are still running; give them a moment.
        for _ in range(50):
            try:
                await self.http.request("/flush_cache", {}, url=url, expect_json=False)
                return
            except Rejected as e:
                if e.status != 400:
                    raise
                await asyncio.sleep(self.poll_interval_s)
        raise EngineError(f"SGLang server at {url} kept refusing /flush_cache (requests still running after pause)")

    async def _resume(self, url: str) -> None:
        await self.http.request("/continue_generation", {}, url=url, expect_json=False, allow_404=True)

    async def _served_version(self, url: str) -> str | None:
        for path in ("/model_info", "/get_model_info", "/get_weight_version"):
            body = await self.http.request(path, url=url, method="GET", allow_404=True)
            if body is not None:
                return str(get_field(body, "weight_version", url, path, self.name))
        raise EngineError(f"SGLang server at {url} has none of /model_info, /get_model_info, /get_weight_version")

    def _push(self, urls: Sequence[str], named: list | None, path: str | None, version: int) -> None:
        if self.weight_sync == "disk":
            if named is not None or not os.path.isdir(path or ""):
                named = named if named is not None else wt.read_checkpoint(path)  # type: ignore[arg-type]
                config_dir = self.model_path if self.model_path and os.path.isdir(self.model_path) else None
                path = wt.write_hf_checkpoint(named, self.weight_sync_dir, version, config_dir=config_dir,
                                              keep=self.keep_checkpoints)
            self._post_all(urls, "/update_weights_from_disk", lambda u: {"model_path": os.path.abspath(path),
                                                                           "weight_version": str(version)})
            return
        named = named if named is not None else wt.read_checkpoint(path)  # type: ignore[arg-type]
        parts = list(wt.buckets(named, self.bucket_bytes)) or [[]]
        tp = {u: self._tp_size(u) for u in urls}
        for i, bucket in enumerate(parts):
            last = i == len(parts) - 1
            if self.weight_sync == "tensor":
                self._post_all(urls, "/update_weights_from_tensor", lambda u, b=bucket, l=last: {
                    "serialized_named_tensors": [_ipc_serialize(b) for _ in range(tp[u])],
                    "flush_cache": False, **({"weight_version": str(version)} if l else {})},
                    attempts=1)  # shared-memory handles are single-use: never resend the same payload
            elif self.weight_sync == "distributed":
                self._broadcast_bucket(urls, bucket, version if last else None)
            else:
                raise EngineError(f"unknown rollout.server.weight_sync {self.weight_sync!r}")

    def _post_all(self, urls: Sequence[str], path: str, payload_for: Any, attempts: int | None = None) -> None:
        async def post(url: str) -> None:
            body = await self.http.request(path, payload_for(url), url=url, attempts=attempts)
            if isinstance(body, dict) and body.get("success") is False:
                raise EngineError(f"SGLang server at {url} could not {path}: {body.get('message', '')}")

        async def all_() -> None:
            await asyncio.gather(*(post(u) for u in urls))

        self.http.run(all_())

    def _tp_size(self, url: str) -> int:
        if url not in self._tp_sizes:
            info = self.http.run(self.http.request("/get_server_info", url=url, method="GET", allow_404=True))
            self._tp_sizes[url] = int((info or {}).get("tp_size", 1))
        return self._tp_sizes[url]

    def _ensure_group(self, urls: Sequence[str]) -> None:
        if self._group is not None:
            return
        sizes = [self._tp_size(u) for u in urls]
        world = 1 + sum(sizes)
        offsets = [1 + sum(sizes[:i]) for i in range(len(urls))]
        addr = self.sync_master_address or local_ip_towards(urls[0])
        port = free_port("")
        bodies = {u: {"master_address": addr, "master_port": port, "rank_offset": off, "world_size": world,
                      "group_name": self._group_name, "backend": self.sync_backend} for u, off in zip(urls, offsets)}
        fut = self.http.submit(self._post_async(urls, "/init_weights_update_group", bodies))
        try:
            self._group = wt.init_custom_process_group(self.sync_backend, f"tcp://{addr}:{port}", world, 0,
                                                       self._group_name, timeout_s=self.confirm_timeout_s)
        finally:
            fut.result(self.confirm_timeout_s)

    def _broadcast_bucket(self, urls: Sequence[str], bucket: list, version: int | None) -> None:
        self._ensure_group(urls)
        meta = {"names": [n for n, _ in bucket], "dtypes": [dtype_name(t.dtype) for _, t in bucket],
                "shapes": [list(t.shape) for _, t in bucket], "group_name": self._group_name,
                "flush_cache": False}
        if version is not None:
            meta["weight_version"] = str(version)
        fut = self.http.submit(self._post_async(urls, "/update_weights_from_distributed", {u: meta for u in urls}))
        try:
            device = wt.sync_device(self.sync_backend)
            for _, t in bucket:
                torch.distributed.broadcast(t.detach().to(device).contiguous(), src=0, group=self._group)
        finally:
            fut.result(self.confirm_timeout_s)

    async def _post_async(self, urls: Sequence[str], path: str, bodies: dict[str, Any]) -> None:
        async def post(url: str) -> None:  # one attempt: a retry would wait for a broadcast that never comes
            body = await self.http.request(path, bodies[url], url=url, attempts=1)
            if isinstance(body, dict) and body.get("success") is False:
                raise EngineError(f"SGLang server at {url} could not {path}: {body.get('message', '')}")

        await asyncio.gather(*(post(u) for u in urls))

    def _before_close(self) -> None:
        if self._group is not None:
            try:
                torch.distributed.destroy_process_group(self._group)
            except Exception:  # noqa: BLE001 - closing must not fail
                pass
            self._group = None


def _single(body: Any) -> Any:
    return body[0] if isinstance(body, list) and len(body) == 1 else body


def _pairs(entries: list, url: str, path: str, field: str) -> tuple[list[int], list[float]]:
    ids, lps = [], []
    for e in entries:
        if not (isinstance(e, (list, tuple)) and len(e) >= 2 and isinstance(e[1], int)
                and isinstance(e[0], (int, float)) and not isinstance(e[0], bool)):
            raise EngineError(f"SGLang server at {url} answered {path} with a malformed {field} entry {str(e)[:60]}")
        ids.append(e[1])
        lps.append(float(e[0]))
    return ids, lps


def _as_int(value: Any, default: int) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return default


def _ipc_serialize(named: list) -> str:
    """base64(ForkingPickler(list of (name, tensor))), SGLang's MultiprocessingSerializer format.
    CPU tensors are copied first: pickling moves a CPU tensor's storage to shared memory."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401 - registers torch's reductions with ForkingPickler

    staged = [(n, t.detach().clone() if t.device.type == "cpu" else t.detach()) for n, t in named]
    buf = io.BytesIO()
    ForkingPickler(buf).dump(staged)
    return base64.b64encode(buf.getvalue()).decode("ascii")
