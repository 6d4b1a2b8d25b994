"""The tensor and distributed weight sync of `SGLangEngine` (a mixin, glmlight/engines/servers/sglang.py):
the new weights go in buckets of `bucket_bytes` inside a weight-update session (/begin_weight_update …
/end_weight_update), the last bucket labelled with the new version:

- tensor: /update_weights_from_tensor with one serialized list of (name, tensor) per TP rank;
- distributed: /init_weights_update_group once (trainer = rank 0, each server's TP ranks from
  rank_offset), then per bucket /update_weights_from_distributed {names, dtypes, shapes, group_name}
  while this process broadcasts the tensors. A server that restarted lost its group: a re-sync builds
  the group again with every server."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Sequence
from typing import Any, Callable

import torch

from glmlight.dtypes import dtype_name
from glmlight.errors import EngineError
from glmlight.engines import transport as wt
from glmlight.engines.servers.launch import free_port, local_ip_towards
from glmlight.engines.servers.sglang_wire import serialize_named_tensors

log = logging.getLogger("glmlight.engines.servers.sglang")


class TensorSync:
    """SGLang's tensor and distributed weight sync, part of SGLangEngine (glmlight/engines/servers/sglang.py);
    what it reads from the engine is declared below."""

    # read from the class this is part of, defined there
    weight_sync: str
    bucket_bytes: int
    sync_backend: str
    sync_master_address: str | None
    confirm_timeout_s: float
    http: Any
    _tp_sizes: Any
    _sessions: Any
    _server_info: Callable[..., Any]
    _post_each: Callable[..., Any]
    _sync_urls: Callable[..., Any]
    _destroy_group: Callable[..., Any]

    def _push_tensors(self, urls: Sequence[str], named: list, version: int, tp: dict[str, int]) -> None:
        parts = list(wt.buckets(named, self.bucket_bytes)) or [[]]
        self._begin(urls)
        try:
            for i, bucket in enumerate(parts):
                label = {"weight_version": str(version)} if i == len(parts) - 1 else {}
                if self.weight_sync == "tensor":
                    payloads, keep = {}, []
                    for u in urls:
                        data, alive = serialize_named_tensors(bucket)
                        payloads[u], keep = [data] * tp[u], keep + [alive]
                    errors = self._post_each(urls, "/update_weights_from_tensor", lambda u: {
                        "serialized_named_tensors": payloads[u], "flush_cache": False, **label},
                        attempts=1)  # a shared-memory handle is opened once: never resend the same payload
                    del keep
                elif self.weight_sync == "distributed":
                    errors = self._broadcast_bucket(urls, bucket, label)
                else:
                    raise EngineError(f"unknown rollout.server.weight_sync {self.weight_sync!r}")
                if errors:
                    url, e = next(iter(errors.items()))
                    raise EngineError(f"SGLang server at {url}: {e}")
        finally:
            self._end(urls)

    def _begin(self, urls: Sequence[str]) -> None:
        for u in urls:
            if self._sessions.get(u, True):
                body = self.http.run(self.http.request("/begin_weight_update", {}, url=u, allow_404=True))
                self._sessions[u] = body is not None

    def _end(self, urls: Sequence[str]) -> None:
        for u in urls:
            if self._sessions.get(u):
                try:
                    self.http.run(self.http.request("/end_weight_update", {}, url=u))
                except EngineError as e:
                    log.warning("SGLang server at %s: /end_weight_update failed: %s", u, e)

    def _tp_size(self, url: str) -> int:
        if url not in self._tp_sizes:
            self._tp_sizes[url] = int((self._server_info(url) or {}).get("tp_size", 1))
        return self._tp_sizes[url]

    def _resync_urls(self, url: str) -> list[str]:
        if self.weight_sync != "distributed":
            return [url]
        if self._group is not None:  # the restarted server lost its group: build it again with every server
            self._post_each(self._sync_urls(), "/destroy_weights_update_group", lambda u: {"group_name": self._group_name},
                            attempts=1)
            self._destroy_group()
            self._group_name = f"glmlight-{uuid.uuid4().hex[:12]}"
        return self._sync_urls()

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
            errors = fut.result(self.confirm_timeout_s)
        if errors:
            raise EngineError(f"SGLang server at {next(iter(errors))}: {next(iter(errors.values()))}")

    def _broadcast_bucket(self, urls: Sequence[str], bucket: list, label: dict) -> dict[str, Exception]:
        self._ensure_group(urls)
        meta = {"names": [n for n, _ in bucket], "dtypes": [dtype_name(t.dtype) for _, t in bucket],
                "shapes": [list(t.shape) for _, t in bucket], "group_name": self._group_name,
                "flush_cache": False, **label}
        fut = self.http.submit(self._post_async(urls, "/update_weights_from_distributed", {u: meta for u in urls}))
        try:
            device = wt.sync_device(self.sync_backend)
            for _, t in bucket:
                torch.distributed.broadcast(t.detach().to(device).contiguous(), src=0, group=self._group)
        finally:
            errors = fut.result(self.confirm_timeout_s)
        return errors

    async def _post_async(self, urls: Sequence[str], path: str, bodies: dict[str, Any]) -> dict[str, Exception]:
        async def post(url: str) -> None:  # one attempt: a retry would wait for a broadcast that never comes
            body = await self.http.request(path, bodies[url], url=url, attempts=1)
            if isinstance(body, dict) and body.get("success") is False:
                raise EngineError(f"SGLang server at {url} could not {path}: {body.get('message', '')}")

        outcomes = await asyncio.gather(*(post(u) for u in urls), return_exceptions=True)
        return {u: o for u, o in zip(urls, outcomes) if isinstance(o, BaseException)}

    def _before_close(self) -> None:
        self._destroy_group()
