"""SGLangEngine: the RolloutEngine protocol over SGLang's native HTTP API (written against SGLang
0.5.23's source and run against the real 0.5.23 on CPU; see docs/servers.md for what each older
release supports).

Generation: POST /generate {rid, input_ids, sampling_params, return_logprob: true}; ids from
meta_info.output_token_logprobs ([[logprob, token_id, text], ...]), the finish reason from
meta_info.finish_reason.type, the weights' version labels from meta_info.weight_versions (spans)
or meta_info.weight_version; replay records from meta_info.routed_experts / .indexer_topk
(`replay_fields`, server_replay.py). Every attempt has its own rid (`<rid>-<attempt>`): SGLang answers 400
"Duplicate request ID" while an earlier attempt is still registered (tokenizer_manager.py
`_init_req_state`).

Log-probs must be those of the distribution the token was sampled from. SGLang's
output_token_logprobs are after temperature but before top-k/top-p (srt/layers/sampler.py), so
when top_k > 0 or top_p < 1 the request also asks `return_sampling_mask: true` and the log-probs
come from meta_info.output_token_sampling_logprobs (log of the sampled token's weight over the
renormalised top-k/top-p support; SGLang's support with both on is the "joint" one,
glmlight/ops/logprobs.py, which `filter_order` declares). SGLang serves that only for top_k == 1 or a finite
1 < top_k <= --sampling-mask-max-tokens (default 4096), so top_p < 1 without top_k is refused at
start (`check_sampling`).

Seeds: sampling_seed is sent, but SGLang uses it only with --enable-deterministic-inference
(`_check_seeding`; `seeded_sampling`).

Prefill scoring (teacher log-probs): /generate with max_new_tokens 0, return_logprob and
logprob_start_len = len(prompt) - 1. input_token_logprobs are aligned with
input_ids[logprob_start_len:] and entry 0 is always None, so entry 0 is the prompt's last token
and entries 1.. are the completion's.

Weight updates: /pause_generation {mode: abort} (in-flight requests return early with
finish_reason abort) → for tensor and distributed, /begin_weight_update (0.5.23 refuses those
updates outside such a session; a server without the endpoint, 404, is updated without) → the
update → /end_weight_update → /flush_cache → /model_info until weight_version is the new
version → /continue_generation. Modes:
- disk: a safetensors checkpoint in HF layout, written atomically to weight_sync_dir/v{version}/,
  then /update_weights_from_disk {model_path, weight_version} (SGLang restores its old weights
  itself when that load fails);
- shm: the same request, the checkpoint written into one of two slots in shared memory
  (`transport.SharedMemorySlots`, same host): no disk, and pages overwritten in place;
- tensor: /update_weights_from_tensor, serialized_named_tensors = one entry per TP rank, each
  base64(ForkingPickler(list of (name, tensor))) as SGLang's MultiprocessingSerializer writes it
  and its SafeUnpickler reads it (srt/utils/common.py). CPU tensors travel as named shared-memory
  segments (torch's "file_system" sharing strategy: a separately started server can open them on
  the same host; the default file-descriptor handles need the sender's multiprocessing authkey),
  CUDA tensors as CUDA IPC handles carrying the device UUID (what SGLang's
  `monkey_patch_torch_reductions`, srt/utils/patch_torch.py, expects);
- distributed: /init_weights_update_group once (trainer = rank 0, each server's TP ranks from
  rank_offset), then per bucket /update_weights_from_distributed {names, dtypes, shapes,
  group_name} while this process broadcasts the tensors (nccl on CUDA, hccl on Ascend, gloo).
If a server fails an update, every server is put back on the previous weights (the previous
checkpoint, the kept copy of the previous tensors, or the checkpoint it was started from) and the
update is retried; if that is impossible the run stops with one line.
"""

from __future__ import annotations

import asyncio
import logging
import os
import uuid
from collections.abc import Sequence
from typing import Any

from glmlight.errors import EngineError
from glmlight.engines import transport as wt
from glmlight.engines.base import SamplingParams
from glmlight.engines.servers.http import Rejected, get_field
from glmlight.engines.servers.launch import sglang_launch
from glmlight.engines.servers.replay_codec import decode_sglang_indexer_topk, decode_sglang_routed_experts
from glmlight.engines.servers.server_checks import check_logprob_definition
from glmlight.engines.servers.server_replay import ReplayField
from glmlight.engines.servers.server_types import Answer, FleetFailed, Source, UpdateFailed, sampling_fields, server_settings
from glmlight.engines.servers.base import ServerEngineBase
from glmlight.engines.servers.sglang_wire import (FilteredLogprobsMissing, attempt_rid, check_sampling,  # noqa: F401
                                         pairs, parse_generate_answer, single)
from glmlight.engines.servers.sglang_tensor_sync import TensorSync

log = logging.getLogger(__name__)
# sglang 0.5.23's reply to a disk update whose weights loaded but whose cache flush was refused
FLUSH_REFUSED_AFTER_LOAD = "Weights were updated, but the cache was not flushed"


class SGLangEngine(TensorSync, ServerEngineBase):
    """See the module docstring; the tensor and distributed weight sync: `TensorSync`
    (sglang_tensor_sync.py)."""

    name = "SGLang"
    health_path = "/health_generate"
    # top-k and top-p over the same un-renormalised distribution (glmlight/ops/logprobs.py `joint_kept`)
    filter_order = "joint"
    replay_fields = {  # replay records (server_replay.py; formats in replay_codec.py)
        "routing": ReplayField({"return_routed_experts": True, "routed_experts_start_len": 0}, "routed_experts",
                               "meta_info.routed_experts", decode_sglang_routed_experts, "--enable-return-routed-experts"),
        "index": ReplayField({"return_indexer_topk": True}, "indexer_topk", "meta_info.indexer_topk",
                             decode_sglang_indexer_topk, "--enable-return-indexer-topk (CUDA or NPU) and "
                             "SGLANG_DSA_FUSE_TOPK=0 in its environment")}

    def __init__(self, urls: Sequence[str] = (), *, weight_sync: str = "disk",
                 weight_sync_dir: str = ".cache/glmlight/weights", model_path: str | None = None,
                 sync_backend: str = "nccl", sync_master_address: str | None = None,
                 bucket_bytes: int = 1 << 30, keep_checkpoints: int = 2, check_logprobs: bool = True, **kwargs: Any):
        self.weight_sync = weight_sync
        self.weight_sync_dir = weight_sync_dir
        self.model_path = model_path
        self.sync_backend = sync_backend
        self.sync_master_address = sync_master_address
        self.bucket_bytes = bucket_bytes
        self.keep_checkpoints = keep_checkpoints
        self.check_logprobs = check_logprobs
        self._group: Any = None
        self._group_name = f"glmlight-{uuid.uuid4().hex[:12]}"
        self._tp_sizes: dict[str, int] = {}
        self._initial_labels: dict[str, str | None] = {}
        self._sessions: dict[str, bool] = {}  # url -> has /begin_weight_update
        self.filtered_logprobs = True  # the servers report top-k/top-p log-probs (return_sampling_mask)
        self.seeded_sampling = True  # the servers honour sampling_seed (`_check_seeding`)
        super().__init__(urls, **kwargs)

    @classmethod
    def from_config(cls, cfg: Any, replay: tuple[bool, bool] = (False, False)) -> SGLangEngine:
        """The engine for the run's config; `replay`: (routing, index), what a managed server must return."""
        check_sampling(cfg.rollout.top_p, cfg.rollout.top_k)
        s, kw = cfg.rollout.server, server_settings(cfg)
        launch = sglang_launch(cfg, kw, replay) if s.launch else None
        return cls(launch=launch, sync_backend=s.sync_backend or "nccl", sync_master_address=s.sync_master_address,
                   check_logprobs=bool(s.check_logprobs), **kw)

    def _after_ready(self) -> None:
        # Health checks pass without a key; an authenticated call finds a refused key now.
        for url in self._sync_urls() if (not self.router or len(self.urls) > 1) else self.urls[:1]:
            self._initial_labels[url] = self.http.run(self._served_label(url))
        self._check_seeding()
        if self.check_logprobs:
            check_logprob_definition(self, "do not set SGLANG_RETURN_ORIGINAL_LOGPROB on the server",
                                     filtered=self._sampling_mask_ok)

    # ------------------------------------------------------------------ generation
    async def _generate_one(self, rid: str, prompt: list[int], p: SamplingParams) -> Answer:
        sp = {**sampling_fields(p), "max_new_tokens": p.max_new_tokens, "no_stop_trim": True}
        if p.seed is not None:
            sp["sampling_seed"] = p.seed
        filtered = p.temperature > 0 and (p.top_k > 0 or p.top_p < 1)
        if filtered and p.top_k <= 0:
            check_sampling(p.top_p, p.top_k)
        if filtered and not self.filtered_logprobs:
            raise FilteredLogprobsMissing("this SGLang server cannot report top-k/top-p log-probs "
                                          "(return_sampling_mask needs SGLang 0.5.18 or later): sample with "
                                          "rollout.top_k=0 and rollout.top_p=1, or upgrade the server")

        def body(url: str, attempt_rid: str | None) -> dict:
            b = {"rid": attempt_rid, "input_ids": prompt, "sampling_params": sp, "return_logprob": True,
                 "stream": False, **self.replay_request()}
            return {**b, "return_sampling_mask": True} if filtered else b

        url, reply = await self.http.request("/generate", None, pool=self.pool, with_url=True, rid_for=attempt_rid(rid),
                                             payload_for=body, on_retry=self._aborter)
        return self._parse_generation(single(reply), url, rid, filtered, len(prompt))

    def _check_seeding(self) -> None:
        """SGLang samples with a request's sampling_seed only when started with
        --enable-deterministic-inference (sglang 0.5.23 srt/sampling/sampling_batch_info.py: the seeds
        are passed to the sampler only in deterministic mode, which refuses torch-native attention, so
        never on CPU). /server_info carries the flag; a server without it (or that does not say) makes
        the engine report `seeded_sampling = False`, and the run is told once."""
        unseeded = []
        for url in self.pool.urls:
            info = self._server_info(url)
            if not (isinstance(info, dict) and info.get("enable_deterministic_inference") is True):
                unseeded.append(url)
        self.seeded_sampling = not unseeded
        if unseeded:
            log.warning("SGLang server(s) %s run without --enable-deterministic-inference: they ignore per-request "
                        "seeds, so sampling is not reproducible (the same seed gives other tokens, and a resumed run "
                        "samples differently from the interrupted one)", ", ".join(unseeded))

    def _server_info(self, url: str) -> Any:
        for path in ("/server_info", "/get_server_info"):
            info = self.http.run(self.http.request(path, url=url, method="GET", allow_404=True))
            if info is not None:
                return info
        return None

    def _sampling_mask_ok(self, error: EngineError) -> bool:
        """The start-up check's top_k=1 request failed: a server without return_sampling_mask (before
        0.5.18) is still fine for sampling without top-k/top-p."""
        if "output_token_sampling_logprobs" not in str(error):
            return False
        log.warning("%s; top-k/top-p sampling will be refused", error)
        self.filtered_logprobs = False
        return True

    def _parse_generation(self, body: Any, url: str, rid: str, filtered: bool, num_prompt: int) -> Answer:
        gen, meta, labels = parse_generate_answer(body, url, rid, filtered, self.name)
        self.attach_records(gen, meta, url, num_prompt)
        return Answer(gen, url, labels)

    async def _score_one(self, rid: str, prompt: list[int], completion: list[int], url: str | None = None) -> list[float]:
        if not completion:
            return []
        payload = {"input_ids": prompt + completion, "return_logprob": True,
                   "logprob_start_len": len(prompt) - 1, "stream": False,
                   "sampling_params": {"max_new_tokens": 0, "temperature": 1.0, "skip_special_tokens": False}}
        target = {"url": url} if url is not None else {"pool": self.pool}
        url, body = await self.http.request("/generate", None, with_url=True, rid_for=attempt_rid(rid),
                                            payload_for=lambda u, r: {"rid": r, **payload}, on_retry=self._aborter,
                                            **target)
        field = "meta_info.input_token_logprobs"
        entries = get_field(single(body), field, url, "/generate", self.name, list)
        if len(entries) != len(completion) + 1:
            raise EngineError(f"SGLang server at {url} answered /generate with {len(entries)} {field} entries, "
                              f"expected {len(completion) + 1} (logprob_start_len = len(prompt) - 1)")
        ids, lps = pairs(entries[1:], url, "/generate", field)
        if ids != completion:
            raise EngineError(f"SGLang server at {url} answered /generate with {field} for other tokens than sent")
        return lps

    async def _aborter(self, url: str, reason: str, attempt_rid: str | None) -> None:
        """Before a retry after a timeout, drop that attempt on the server (best effort)."""
        if reason.startswith("no answer") and attempt_rid:
            try:
                await self.http.request("/abort_request", {"rid": attempt_rid}, url=url, attempts=1, timeout_s=5,
                                        expect_json=False, allow_404=True)
            except EngineError:
                pass

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
        raise UpdateFailed(f"SGLang server at {url} kept refusing /flush_cache (requests still running after pause)")

    async def _resume(self, url: str) -> None:
        await self.http.request("/continue_generation", {}, url=url, expect_json=False, allow_404=True)

    async def _probe_alive(self, url: str) -> None:
        """/health and /health_generate run a one-token generation, which a paused server holds: they
        answer 503 after 20 s (sglang 0.5.23 srt/entrypoints/http_server.py `health_generate`,
        HEALTH_CHECK_TIMEOUT). /model_info is answered by the HTTP process itself, paused or not."""
        await self.http.request("/model_info", url=url, method="GET", attempts=1, timeout_s=10, allow_404=True)

    async def _served_label(self, url: str) -> str | None:
        for path in ("/model_info", "/get_model_info"):  # 0.5.23 has no /get_weight_version
            body = await self.http.request(path, url=url, method="GET", allow_404=True)
            if body is not None:
                return str(get_field(body, "weight_version", url, path, self.name))
        raise EngineError(f"SGLang server at {url} has neither /model_info nor /get_model_info")

    def _push(self, urls: Sequence[str], named: list | None, path: str | None, version: int) -> Source:
        prev = self._previous()
        source = Source(version, str(version))
        if self.weight_sync in ("disk", "shm"):
            try:
                config_dir = self.model_path if self.model_path and os.path.isdir(self.model_path) else None
                if self.weight_sync == "shm":  # SGLang's loader reads the slot's file: in /dev/shm, a memcpy
                    path = self._write_shm(named if named is not None else wt.map_checkpoint(path), config_dir)  # type: ignore[arg-type]
                elif named is not None or not os.path.isdir(path or ""):
                    named = named if named is not None else wt.read_checkpoint(path)  # type: ignore[arg-type]
                    path = wt.write_hf_checkpoint(named, self.weight_sync_dir, version, config_dir=config_dir,
                                                  keep=self.keep_checkpoints)
            except OSError as e:
                raise UpdateFailed(f"could not write the checkpoint: {e}") from None
            source.path = os.path.abspath(path)  # type: ignore[arg-type]
            errors = self._post_each(urls, "/update_weights_from_disk",
                                     lambda u: {"model_path": source.path, "weight_version": str(version)})
            errors = self._loaded_anyway(errors, version)
            if errors:  # SGLang put its own weights back where the load failed; the others go back too
                self._revert([u for u in urls if u not in errors], prev, errors)
            return source
        try:
            named = named if named is not None else wt.read_checkpoint(path)  # type: ignore[arg-type]
            tp = {u: self._tp_size(u) for u in urls}
        except (OSError, EngineError) as e:
            raise UpdateFailed(str(e)) from None
        try:
            self._push_tensors(urls, named, version, tp)
        except (EngineError, RuntimeError) as e:  # RuntimeError: a failed broadcast
            self._revert(urls, prev, {u: e for u in urls})
        return source

    def _loaded_anyway(self, errors: dict[str, Exception], version: int) -> dict[str, Exception]:
        """The failures of a disk update where the new weights did not go in. SGLang 0.5.23 answers
        HTTP 400 `success: false` also when the weights loaded and its scheduler's weight version
        (the one stamped on answers) moved, but the cache flush that follows was refused because
        requests were still running (srt/managers/scheduler_components/weight_updater.py
        `flush_cache_after_weight_update`; /model_info keeps the old version, which the HTTP process
        moves only on success). Such a server is neither put back nor loaded twice: its reply says the
        weights are in, /update_weight_version (abort_all_requests false) makes /model_info report the
        same version, and `_flush` flushes its cache once the requests are gone. Any other failure
        counts unless /model_info already reports the new version."""
        left = {}
        for url, e in errors.items():
            if FLUSH_REFUSED_AFTER_LOAD in str(e):
                log.warning("SGLang server at %s loaded weight version %d but could not flush its cache yet: %s",
                            url, version, e)
                try:
                    self.http.run(self.http.request("/update_weight_version", {"new_version": str(version),
                                                                               "abort_all_requests": False}, url=url))
                    continue
                except EngineError as e2:
                    e = e2
            try:
                served = self.http.run(self._served_label(url))
            except EngineError:
                served = None
            if served == str(version):
                log.warning("SGLang server at %s reports weight version %d after answering: %s", url, version, e)
            else:
                left[url] = e
        return left

    def _revert(self, urls: Sequence[str], prev: Source, errors: dict[str, Exception]) -> None:
        """Put `urls` back on the previous weights, then raise UpdateFailed (FleetFailed if that fails)."""
        first = f"{next(iter(errors))}: {next(iter(errors.values()))}"
        if urls:
            try:
                if prev.named is not None and self.weight_sync not in ("disk", "shm"):
                    self._push_tensors(urls, prev.named, prev.version, {u: self._tp_size(u) for u in urls})
                else:
                    model_path = prev.path or self.model_path
                    labels = {u: prev.label or self._initial_labels.get(u) or "default" for u in urls}
                    if not model_path:
                        raise EngineError("no previous checkpoint to load")
                    bad = self._post_each(urls, "/update_weights_from_disk",
                                          lambda u: {"model_path": os.path.abspath(model_path),
                                                     "weight_version": labels[u]})
                    if bad:
                        raise next(iter(bad.values()))
            except Exception as e:  # noqa: BLE001
                raise FleetFailed(f"SGLang: a weight update failed ({first}) and {sorted(urls)} could not be put back "
                                  f"on the previous weights ({e}); servers now serve different weights") from None
        raise UpdateFailed(f"update failed on {first}")

    def _post_each(self, urls: Sequence[str], path: str, payload_for: Any, attempts: int | None = None
                   ) -> dict[str, Exception]:
        async def post(url: str) -> None:
            body = await self.http.request(path, payload_for(url), url=url, attempts=attempts)
            if isinstance(body, dict) and body.get("success") is False:
                raise EngineError(f"SGLang server at {url} could not {path}: {body.get('message', '')}")

        async def all_() -> list:
            return await asyncio.gather(*(post(u) for u in urls), return_exceptions=True)

        return {u: o for u, o in zip(urls, self.http.run(all_())) if isinstance(o, BaseException)}
