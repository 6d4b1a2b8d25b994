"""vLLM and vLLM-Ascend engines: the RolloutEngine protocol over vLLM's OpenAI-compatible server
(0.32 and 0.33; run for real on vLLM's CPU build 0.32.0), or over an in-process `vllm.LLM`.

Generation: POST /v1/completions with the prompt as token ids, `logprobs: 0` (the sampled token's
log-prob only), `return_token_ids` (choices[0].token_ids; older servers: tokens spelt
"token_id:<id>" via `return_tokens_as_token_ids`) and, on 0.33, `return_weight_versions`
(choices[0].weight_versions: the version label of every token span); with routing replay on,
`routed_experts_prompt_start: 0` (choices[0].routed_experts; `replay_fields`, server_replay.py;
vLLM returns no DSA selection, so index replay is refused). The log-probs must be those
of the distribution each token was sampled from — temperature, then top-k/top-p, renormalised:
vLLM's `--logprobs-mode processed_logprobs` (vllm/v1/sample/sampler.py and
vllm/v1/sample/ops/topk_topp_sampler.py); a managed launch sets it, and a server that reports
anything else is refused at start (`check_logprob_definition` in servers.py). Finish reasons:
stop, length, abort (a pause aborted the request: the partial answer), repetition (treated as
length), error (the request failed: FAILED). Prefill scoring: `prompt_logprobs: 0` returns, per
prompt position i > 0, a dict keyed by token id (a string) that always holds the prompt's own
token; the completion's entries start at len(prompt).

Weight updates use vLLM's dev-mode endpoints (VLLM_SERVER_DEV_MODE=1) and the worker extension
`glmlight.engines.servers.vllm_worker.WeightLoaderExtension` (`--worker-extension-cls`; a managed launch
adds both and puts glmlight on the server's PYTHONPATH):

    /pause?mode=abort → stage every bucket on every server (/collective_rpc glmlight_load_payload,
    glmlight_update_distributed or glmlight_load_path) → glmlight_commit on every server (layerwise
    reload; a failure there restores that server's previous weights) → glmlight_release, or, if
    any server failed, glmlight_revert on the others → /update_weight_version (what
    weight_versions and /weight_info report) → /reset_prefix_cache (checked: {"success": true})
    → confirm every worker's version → /resume

weight_sync=shm writes the checkpoint into one of two shared-memory slots
(`transport.SharedMemorySlots`) and glmlight_load_path maps it ({"map": true}): each byte is copied
once by the trainer and once by the reload, on the same host. The commit reports what its stages
took (`last_sync_seconds`). weight_sync=tensor with `delta_sync` sends, against the tensors of the
last committed version (in the served dtype), only the elements that changed
(glmlight/engines/weight_delta.py); the worker rebuilds the rest from the copy it kept. A re-sync
of a restarted server and the retry after any failed update send everything.

/collective_rpc passes string arguments only, so each call carries one JSON string. A 500 from it
("Call to collective_rpc method failed: ...": an unknown method, a failed load) is not retried.
vLLM's API-key middleware guards /v1, /v2, /inference and /cohere paths only; the dev endpoints are
open to whoever reaches the port. While paused, vLLM 0.32 holds new requests and 0.33 answers
503 "Generation is paused": the client waits for the resume in both cases.

In-process (`VLLMInProcessEngine`): `vllm.LLM(..., worker_extension_cls=...)` and
`LLM.collective_rpc`; vllm is imported lazily and only there.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import uuid
from collections.abc import Sequence
from typing import Any

from glmlight.dtypes import dtype_name
from glmlight.errors import EngineError
from glmlight.engines import transport as wt
from glmlight.engines.weight_delta import DeltaSender
from glmlight.engines.base import Generation, NamedTensors, SamplingParams
from glmlight.engines.servers.http import AuthError, get_field
from glmlight.engines.servers.launch import free_port, local_ip_towards, vllm_index_refusal, vllm_launch
from glmlight.engines.servers.replay_codec import decode_vllm_routed_experts
from glmlight.engines.servers.server_checks import check_logprob_definition
from glmlight.engines.servers.server_replay import ReplayField
from glmlight.engines.servers.vllm_wire import (ASCEND_OPTIONS, EXTENSION, FINISH_REASONS, rpc_failed, token_id,  # noqa: F401
                                        version_tuple)
from glmlight.engines.servers.server_types import Answer, FleetFailed, Source, UpdateFailed, sampling_fields, server_settings
from glmlight.engines.servers.base import ServerEngineBase

log = logging.getLogger(__name__)
class VLLMEngine(ServerEngineBase):
    name = "vLLM"
    health_path = "/health"
    # top-k, renormalise, then top-p (vllm 0.32.0 vllm/v1/sample/ops/topk_topp_sampler.py
    # `apply_top_k_top_p_pytorch`): glmlight's own order (glmlight/ops/logprobs.py)
    filter_order = "sequential"
    replay_fields = {  # routed experts only: vLLM returns no DSA selection (server_replay.py, replay_codec.py)
        "routing": ReplayField({"routed_experts_prompt_start": 0}, "routed_experts", "choices.0.routed_experts",
                               decode_vllm_routed_experts, "--enable-return-routed-experts (and Model Runner V2: "
                               "VLLM_USE_V2_MODEL_RUNNER=1)")}

    def __init__(self, urls: Sequence[str] = (), *, weight_sync: str = "disk",
                 weight_sync_dir: str = ".cache/glmlight/weights", model_path: str | None = None,
                 served_model: str | None = None, sync_backend: str = "nccl", sync_master_address: str | None = None,
                 bucket_bytes: int = 1 << 28, keep_checkpoints: int = 2, ascend: bool = False,
                 check_logprobs: bool = True, delta_sync: bool = False, **kwargs: Any):
        self.name = "vLLM-Ascend" if ascend else "vLLM"
        self.weight_sync, self.weight_sync_dir, self.model_path = weight_sync, weight_sync_dir, model_path
        self.served_model = served_model
        self.sync_backend, self.sync_master_address = sync_backend, sync_master_address
        self.bucket_bytes, self.keep_checkpoints = bucket_bytes, keep_checkpoints
        self.check_logprobs = check_logprobs
        self.delta = DeltaSender() if delta_sync else None  # weight_sync=tensor: changed elements only
        self._served_dtype: str | None = None
        self.last_sync_bytes: dict[str, int] = {}  # delta sync: the last update's bytes sent and whole
        self.server_versions: dict[str, tuple[int, ...]] = {}
        self._sync_problem: dict[str, str] = {}
        self._workers: dict[str, int] = {}
        self._group: Any = None
        self._group_name = f"glmlight-{os.urandom(6).hex()}"
        if ascend:
            log.info("vLLM-Ascend engine: device %s, weight-sync backend %s", ASCEND_OPTIONS["device"], sync_backend)
        super().__init__(urls, **kwargs)

    @classmethod
    def from_config(cls, cfg: Any, replay: tuple[bool, bool] = (False, False)) -> VLLMEngine:
        """The engine for the run's config; `replay`: (routing, index), what a managed server must return."""
        s, kw = cfg.rollout.server, server_settings(cfg)
        ascend = cfg.rollout.backend == "vllm_ascend"
        launch = vllm_launch(cfg, kw, replay) if s.launch else None
        backend = s.sync_backend or (ASCEND_OPTIONS["sync_backend"] if ascend else "nccl")
        return cls(launch=launch, ascend=ascend, sync_backend=backend, sync_master_address=s.sync_master_address,
                   check_logprobs=bool(s.check_logprobs), delta_sync=bool(s.delta_sync), **kw)

    def _refuse_replay(self, routing: bool, index: bool) -> str | None:
        return vllm_index_refusal(self.name) if index else None

    def _after_ready(self) -> None:
        if self.served_model is None:
            body = self.http.run(self.http.request("/v1/models", url=self.urls[0], method="GET"))
            self.served_model = str(get_field(body, "data.0.id", self.urls[0], "/v1/models", self.name))
        for url in self.urls[:1] if self.router else self.urls:
            body = self.http.run(self.http.request("/version", url=url, method="GET", allow_404=True))
            self.server_versions[url] = version_tuple((body or {}).get("version") if isinstance(body, dict) else None)
        for url in (self._sync_urls() if not self.router or len(self.urls) > 1 else []):
            self.http.run(self._probe_sync(url))
        if self.check_logprobs:
            check_logprob_definition(self, "start the server with --logprobs-mode processed_logprobs")

    async def _probe_sync(self, url: str) -> None:
        """Find out whether this server can take weight updates (dev mode + our worker extension)."""
        try:
            results = await self._rpc(url, "glmlight_weight_version", None, attempts=1, allow_404=True)
        except AuthError:
            raise
        except EngineError as e:
            self._sync_problem[url] = (f"its workers lack the weight loader ({e}); start vLLM with "
                                       f"--worker-extension-cls {EXTENSION} and glmlight on its PYTHONPATH")
            return
        if results is None:
            self._sync_problem[url] = ("it has no /collective_rpc; start it with VLLM_SERVER_DEV_MODE=1 and "
                                       f"--worker-extension-cls {EXTENSION}, or use the in-process engine")
            return
        problems = sorted({str(r["problem"]) for r in results if r.get("problem")})
        if problems:  # a worker that cannot load updates (vLLM-Ascend weights in FRACTAL_NZ)
            self._sync_problem[url] = "; ".join(problems)
        self._workers[url] = len(results)
        self._served_dtype = next((str(r["dtype"]) for r in results if r.get("dtype")), self._served_dtype)

    # ------------------------------------------------------------------ generation
    async def _generate_one(self, rid: str, prompt: list[int], p: SamplingParams) -> Answer:
        payload = {"model": self.served_model, "prompt": prompt, "max_tokens": p.max_new_tokens, **sampling_fields(p),
                   "n": 1, "stream": False, "logprobs": 0, "return_token_ids": True,
                   "return_tokens_as_token_ids": True, "request_id": rid, **self.replay_request()}
        if p.seed is not None:
            payload["seed"] = p.seed
        url, body = await self.http.request("/v1/completions", payload, pool=self.pool, rid=rid, with_url=True,
                                            payload_for=self._with_versions(payload))
        path = "/v1/completions"
        choice = get_field(body, "choices.0", url, path, self.name, dict)
        reason = choice.get("finish_reason")
        if reason not in FINISH_REASONS:
            raise EngineError(f"{self.name} server at {url} answered {path} with choices.0.finish_reason {reason!r}")
        if reason == "error":
            return Answer(Generation([], [], "error", []), url, [])
        lps = get_field(body, "choices.0.logprobs.token_logprobs", url, path, self.name, list)
        ids = choice.get("token_ids")
        if ids is None:
            tokens = get_field(body, "choices.0.logprobs.tokens", url, path, self.name, list)
            ids = [token_id(t, url) for t in tokens]
        if len(ids) != len(lps) or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in lps):
            raise EngineError(f"{self.name} server at {url} answered {path} with choices.0.token_ids and "
                              "choices.0.logprobs.token_logprobs that do not match")
        labels = [str(span.get("version")) for span in choice.get("weight_versions") or [] if isinstance(span, dict)]
        gen = Generation(token_ids=[int(i) for i in ids], logprobs=[float(x) for x in lps],
                         finish_reason=FINISH_REASONS[reason], versions=[])
        self.attach_records(gen, choice, url, len(prompt))
        return Answer(gen, url, labels)

    def _labels_answers(self, url: str) -> bool:
        return self.server_versions.get(url, ()) >= (0, 33)  # weight_versions: 0.33 and later

    def _with_versions(self, payload: dict) -> Any:
        """The body for one server: 0.33 reports per-span weight versions when asked (0.32 would
        ignore the field with a warning per request)."""
        versioned = {**payload, "return_weight_versions": True}
        return lambda url, rid: versioned if self.server_versions.get(url, ()) >= (0, 33) else payload

    async def _score_one(self, rid: str, prompt: list[int], completion: list[int], url: str | None = None) -> list[float]:
        if not completion:
            return []
        payload = {"model": self.served_model, "prompt": prompt + completion, "max_tokens": 1, "temperature": 1.0,
                   "prompt_logprobs": 0, "n": 1, "stream": False, "request_id": rid}
        target = {"url": url} if url is not None else {"pool": self.pool}
        url, body = await self.http.request("/v1/completions", payload, rid=rid, with_url=True, **target)
        field = "choices.0.prompt_logprobs"
        entries = get_field(body, field, url, "/v1/completions", self.name, list)
        if len(entries) != len(prompt) + len(completion):
            raise EngineError(f"{self.name} server at {url} answered /v1/completions with {len(entries)} "
                              f"{field} entries, expected {len(prompt) + len(completion)}")
        out = []
        for tok, entry in zip(completion, entries[len(prompt):]):
            item = entry.get(str(tok)) if isinstance(entry, dict) else None
            if not isinstance(item, dict) or not isinstance(item.get("logprob"), (int, float)):
                raise EngineError(f"{self.name} server at {url} answered /v1/completions without {field} for token {tok}")
            out.append(float(item["logprob"]))
        return out

    # ------------------------------------------------------------------ weight sync
    def update_weights(self, named_tensors: NamedTensors | None = None, *, path: str | None = None, version: int) -> None:
        for url in self._sync_urls():
            if url in self._sync_problem:
                raise EngineError(f"{self.name} server at {url} cannot take weight updates: {self._sync_problem[url]}")
        super().update_weights(named_tensors, path=path, version=version)

    async def _pause(self, url: str) -> None:
        await self.http.request("/pause?mode=abort", None, url=url, expect_json=False, allow_404=True)

    async def _flush(self, url: str) -> None:
        # /pause cleared the caches already (clear_cache=true); this also covers a server paused elsewhere.
        for _ in range(50):
            body = await self.http.request("/reset_prefix_cache", None, url=url, allow_404=True, expect_json=False)
            if body is None or not body.strip() or json.loads(body).get("success", True) is not False:
                return
            await asyncio.sleep(self.poll_interval_s)  # {"success": false}: blocks still held
        raise UpdateFailed(f"{self.name} server at {url} kept answering /reset_prefix_cache with success false")

    async def _resume(self, url: str) -> None:
        await self.http.request("/resume", None, url=url, expect_json=False, allow_404=True)

    async def _served_label(self, url: str) -> str | None:
        results = await self._rpc(url, "glmlight_weight_version", None)
        versions = {r.get("weight_version") for r in results}
        return versions.pop() if len(versions) == 1 else f"mixed {sorted(map(str, versions))}"

    async def _rpc(self, url: str, method: str, spec: dict | None, attempts: int | None = None,
                   allow_404: bool = False) -> list | None:
        body = await self.http.request("/collective_rpc", {"method": method, "args": [] if spec is None else
                                                           [json.dumps(spec)]}, url=url, attempts=attempts,
                                       allow_404=allow_404, permanent=rpc_failed)
        if body is None:
            return None
        results = get_field(body, "results", url, "/collective_rpc", self.name, list)
        if not results or not all(isinstance(r, dict) and "weight_version" in r for r in results):
            raise EngineError(f"{self.name} server at {url} answered /collective_rpc {method} without "
                              "results[].weight_version")
        return results

    def _rpc_all(self, urls: Sequence[str], method: str, specs: dict[str, dict], attempts: int | None = None):
        async def one(u: str) -> Any:
            return await self._rpc(u, method, specs[u], attempts=attempts)

        async def all_() -> list:
            return await asyncio.gather(*(one(u) for u in urls), return_exceptions=True)

        return all_()

    def _each(self, urls: Sequence[str], method: str, spec: dict, attempts: int | None = None) -> dict[str, Exception]:
        """`method(spec)` on every server at once; the errors, by URL."""
        outcomes = self.http.run(self._rpc_all(urls, method, {u: spec for u in urls}, attempts))
        return {u: o for u, o in zip(urls, outcomes) if isinstance(o, BaseException)}

    def _push(self, urls: Sequence[str], named: list | None, path: str | None, version: int) -> Source:
        uid = f"v{version}-{uuid.uuid4().hex[:8]}"
        source = Source(version, str(version))
        delta = self.delta is not None and self.weight_sync == "tensor"
        resync = version == self.version  # a restarted server gets the current weights: whole, not a delta
        try:
            buckets = self._stage(urls, named, path, version, uid, source, resync)
        except BaseException as e:
            self._each(urls, "glmlight_abort_update", {}, attempts=1)
            if delta:
                self.delta.forget()
            if isinstance(e, (EngineError, OSError, RuntimeError)):
                raise UpdateFailed(f"staging failed: {e}") from None
            raise
        commit = {"update_id": uid, "version": str(version), "buckets": buckets,
                  **(self.delta.commit_spec(resync) if delta else {})}
        outcomes = self.http.run(self._rpc_all(urls, "glmlight_commit", {u: commit for u in urls}, attempts=1))
        errors = {u: o for u, o in zip(urls, outcomes) if isinstance(o, BaseException)}
        for o in outcomes:  # what the first server's first worker measured (staging, host copy, reload)
            if not isinstance(o, BaseException) and o and isinstance(o[0].get("seconds"), dict):
                self.last_sync_seconds.update({f"server_{k}": float(x) for k, x in o[0]["seconds"].items()})
                break
        done = [u for u in urls if u not in errors]
        if delta and errors:
            self.delta.forget()
        elif delta:
            self.delta.committed(version, resync)
        if errors:
            bad = self._each(done, "glmlight_revert", {"update_id": uid}, attempts=1)
            if bad:
                raise FleetFailed(f"{self.name}: update to version {version} failed on {sorted(errors)} and "
                                  f"{sorted(bad)} could not go back to the previous weights: {next(iter(bad.values()))}")
            for u in done:
                self._expect[u] = self._current.label
            raise UpdateFailed(f"commit failed on {sorted(errors)}: {next(iter(errors.values()))}")
        self._each(urls, "glmlight_release", {"update_id": uid}, attempts=1)
        # what 0.33 stamps on answers (weight_versions) and /weight_info reports
        self._run_all(lambda u: self.http.request("/update_weight_version", {"new_version": str(version)}, url=u,
                                                  allow_404=True, expect_json=False), urls)
        return source

    def _stage(self, urls: Sequence[str], named: list | None, path: str | None, version: int, uid: str,
               source: Source, resync: bool = False) -> int:
        """Send the update to every server's workers (nothing is loaded yet); the number of buckets."""
        config_dir = self.model_path if self.model_path and os.path.isdir(self.model_path) else None
        if self.weight_sync == "shm":
            named = named if named is not None else wt.map_checkpoint(path)  # type: ignore[arg-type]
            source.path = self._write_shm(named, config_dir)
            self._raise_first(self._each(urls, "glmlight_load_path", {"path": source.path, "update_id": uid, "map": True}))
            return 1
        if self.weight_sync == "disk":
            if named is not None or not os.path.isdir(path or ""):
                named = named if named is not None else wt.read_checkpoint(path)  # type: ignore[arg-type]
                path = wt.write_hf_checkpoint(named, self.weight_sync_dir, version, config_dir=config_dir,
                                              keep=self.keep_checkpoints)
            source.path = os.path.abspath(path)  # type: ignore[arg-type]
            self._raise_first(self._each(urls, "glmlight_load_path", {"path": source.path, "update_id": uid}))
            return 1
        named = named if named is not None else wt.read_checkpoint(path)  # type: ignore[arg-type]
        if self.delta is not None and self.weight_sync == "tensor":
            named = self.delta.wire(named, self._served_dtype, whole=resync)
            self.last_sync_bytes = dict(self.delta.last)
        parts = list(wt.buckets(named, self.bucket_bytes)) or [[]]
        for i, bucket in enumerate(parts):
            if self.weight_sync == "tensor":
                spec = {"data": wt.encode_safetensors(bucket), "update_id": uid, "bucket": i}
                self._raise_first(self._each(urls, "glmlight_load_payload", spec))
            elif self.weight_sync == "distributed":
                self._broadcast_bucket(urls, bucket, uid, i)
            else:
                raise EngineError(f"unknown rollout.server.weight_sync {self.weight_sync!r}")
        return len(parts)

    @staticmethod
    def _raise_first(errors: dict[str, Exception]) -> None:
        if errors:
            url, e = next(iter(errors.items()))
            raise e if isinstance(e, EngineError) else EngineError(f"server at {url}: {e}")

    def _resync_urls(self, url: str) -> list[str]:
        if self.weight_sync != "distributed":
            return [url]
        self._reset_group()  # the restarted server lost its group: build it again with every server
        return self._sync_urls()

    def _reset_group(self) -> None:
        if self._group is None:
            return
        self._each(self._sync_urls(), "glmlight_destroy_group", {"group_name": self._group_name}, attempts=1)
        self._destroy_group()
        self._group_name = f"glmlight-{os.urandom(6).hex()}"

    def _broadcast_bucket(self, urls: Sequence[str], bucket: list, uid: str, index: int) -> None:
        import torch

        if self._group is None:
            world = 1 + sum(self._workers[u] for u in urls)
            offsets = [1 + sum(self._workers[u] for u in urls[:i]) for i in range(len(urls))]
            addr, port = self.sync_master_address or local_ip_towards(urls[0]), free_port("")
            specs = {u: {"master_address": addr, "master_port": port, "rank_offset": off, "world_size": world,
                         "group_name": self._group_name, "backend": self.sync_backend,
                         "timeout_s": self.confirm_timeout_s} for u, off in zip(urls, offsets)}
            fut = self.http.submit(self._rpc_all(urls, "glmlight_init_group", specs, attempts=1))
            try:
                self._group = wt.init_custom_process_group(self.sync_backend, f"tcp://{addr}:{port}", world, 0,
                                                           self._group_name, timeout_s=self.confirm_timeout_s)
            finally:
                self._raise_first({u: o for u, o in zip(urls, fut.result(self.confirm_timeout_s))
                                   if isinstance(o, BaseException)})
        spec = {"names": [n for n, _ in bucket], "dtypes": [dtype_name(t.dtype) for _, t in bucket],
                "shapes": [list(t.shape) for _, t in bucket], "group_name": self._group_name,
                "backend": self.sync_backend, "update_id": uid, "bucket": index}
        fut = self.http.submit(self._rpc_all(urls, "glmlight_update_distributed", {u: spec for u in urls}, attempts=1))
        try:
            device = wt.sync_device(self.sync_backend)
            for _, t in bucket:
                torch.distributed.broadcast(t.detach().to(device).contiguous(), src=0, group=self._group)
        finally:
            self._raise_first({u: o for u, o in zip(urls, fut.result(self.confirm_timeout_s))
                               if isinstance(o, BaseException)})

    def _before_close(self) -> None:
        if self._group is not None:  # the servers' side too: groups would pile up in their workers
            try:
                self._each(self._sync_urls(), "glmlight_destroy_group", {"group_name": self._group_name}, attempts=1)
            except Exception:  # noqa: BLE001 - closing must not fail
                pass
        self._destroy_group()
